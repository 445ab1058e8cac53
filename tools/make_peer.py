"""The llama.cpp section of docs/benchmarks.md from its records (docs/peer_llamacpp_w8.json, docs/peer_llamacpp.json).

    python -m tools.make_peer [--check]       # = tools/make_benchmarks.py --render-only (or --check)

Each record comes from `molora bench peer --json docs/<record>` (molora.bench.peer; the command it ran is in it).
`section` renders the lines; tools/make_benchmarks.py, which renders the whole page, places them. This script
measures nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def variant_table(rec: dict) -> list[str]:
    out = [
        "| molora | llama.cpp | molora tok/s | llama.cpp tok/s | llama.cpp / molora time | + LoRA: molora | "
        "+ LoRA: llama.cpp | + LoRA: llama.cpp / molora | LoRA cost molora / llama.cpp | greedy agree (LoRA) | "
        "spread |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, v in rec["variants"].items():
        t, ll = v["tok_s"], v["llama.cpp"]
        # the largest max/min over one system's repetitions: far above 1, a repetition stalled (the load)
        spread = max(max(x) / min(x) for x in v["samples_s"].values())
        out.append(
            f"| {name} | {ll['gguf_type']} | {t['molora']:.1f} | {t['llama.cpp']:.1f} | "
            f"{v['llama_over_molora'][0]:.2f}x | {t['molora_lora']:.1f} | {t['llama.cpp_lora']:.1f} | "
            f"{v['llama_over_molora_lora'][0]:.2f}x | {v['lora_cost_molora'][0]:.2f}x / {v['lora_cost_llama'][0]:.2f}x"
            f" | {v['greedy_agreement']:.2f} ({v['greedy_agreement_lora']:.2f}) | {spread:.1f}x |"
        )
    return out


def files_table(rec: dict) -> list[str]:
    out = [
        "| variant | molora weights MB | GGUF file MB | molora / GGUF | GGUF tensor types | llama.cpp KV cache |",
        "|---|---:|---:|---:|---|---|",
    ]
    for name, v in rec["variants"].items():
        ll = v["llama.cpp"]
        types = ", ".join(f"{k} x{n}" for k, n in ll["tensor_types"].items())
        mol = v["molora"]["dtype"] + (f", {v['molora']['quantization']}" if v["molora"]["quantization"] else "")
        kinds = v["molora"].get("weight_bytes_by_kind")
        by = " (" + ", ".join(f"{k} {b / 1e6:.1f}" for k, b in kinds.items()) + ")" if kinds else ""
        out.append(
            f"| {name} ({mol}) | {v['molora']['weight_bytes'] / 1e6:.1f}{by} | {ll['file_bytes'] / 1e6:.1f} | "
            f"{v['molora']['weight_bytes'] / ll['file_bytes']:.2f}x | {types} | {ll['kv_type']} |"
        )
    return out


# The records: (file, title, how molora's weights were counted). The first two with the prefix cache off on
# molora's side and w8a8 on torch._int_mm, llama.cpp's repacked layouts off and on; the next two with the weight-only
# int8 and the honest weight count (every resident copy), at 1 and 2 threads; the last when int8 meant W8A8 (now
# `w8a8`) and the weights counted were the model's tensors only. All but the first two timed molora with its prefix
# cache on: its repetitions after the first found up to three quarters of their prompt blocks cached.
RECORDS = (
    (
        "peer_llamacpp_qhead.json",
        "prefix cache off, int8 with its LM head in int8 too (int8-qhead) beside int8",
        "molora's weights: every resident copy (the model's, the packed kernel copies)",
    ),
    (
        "peer_llamacpp_nocache.json",
        "prefix cache off, w8a8 on torch._int_mm",
        "molora's weights: every resident copy (the model's, the packed kernel copies)",
    ),
    (
        "peer_llamacpp_nocache_repack.json",
        "prefix cache off, llama.cpp's repacked layouts on",
        "molora's weights: every resident copy (the model's, the packed kernel copies)",
    ),
    (
        "peer_llamacpp_w8.json",
        "weight-only int8 (molora's prefix cache on)",
        "molora's weights: every resident copy (the model's, the packed kernel copies)",
    ),
    (
        "peer_llamacpp_w8_2threads.json",
        "weight-only int8, 2 threads (molora's prefix cache on)",
        "molora's weights: every resident copy (the model's, the packed kernel copies)",
    ),
    (
        "peer_llamacpp.json",
        "W8A8 era: its int8 is the old W8A8 path, now `--quantization w8a8` (molora's prefix cache on)",
        "molora's weights: the model's tensors only (the packed kernel copies not counted)",
    ),
)


def record_lines(docs: Path, name: str, title: str, weights: str) -> list[str]:
    """One record's lines (none while it is missing)."""
    path = docs / name
    if not path.is_file():
        return []
    rec = json.loads(path.read_text())
    m, ll = rec["machine"], rec["llama_cpp"]
    command = rec.get("command", f"molora bench peer --json docs/{name}")
    head = (
        f"Measured on {m['cpu']} ({', '.join(m['cpu_flags_all'])}), {m['cores']} cores shared with other work (load "
        f"average {m['loadavg_1_5_15']} before, {m['loadavg_after']} after): read the ratios, not the absolute "
        f"figures. llama.cpp through llama-cpp-python {ll['llama_cpp_python']} ({ll['api']}, one sequence id per "
        f"request, n_batch {ll['n_batch']}; its repacked weight layouts for AMX / CPU_REPACK: {ll['extra_bufts']}), "
        f"{ll['n_threads']} thread(s) on both sides. {rec['requests']} requests x "
        f"({rec['prompt_len']} prompt + {rec['new_tokens']} new tokens), random token ids, greedy, eos ignored, the "
        f"same ids to both; medians of {rec['repeats']} repetitions with the four systems' order rotated; ratios "
        "are paired per repetition (> 1: molora is faster; LoRA cost > 1: the LoRA slows it down). LoRA: "
        f"{rec['lora']}, converted for llama.cpp by `molora.bench.peer_gguf`. Float GGUFs: {rec['float_files']}; "
        f"quantized ones: {rec['quantized_files']}. Greedy agree: the share of molora's tokens llama.cpp repeats "
        "before the first difference (meaningful where the precisions match). Spread: the largest max / min over "
        "one system's repetitions (far above 1: a repetition stalled under the load; read that row's ratios with "
        f"care). {weights}. Record: `{command}` "
        f"(docs/{name}); rendered by `tools/make_peer.py`."
    )
    return [
        f"### {title}",
        "",
        head,
        "",
        *variant_table(rec),
        "",
        *files_table(rec),
        "",
        f"llama.cpp system info: `{ll['system_info']}`",
        "",
    ]


def section(docs: Path) -> list[str]:
    """The "llama.cpp as a peer" section from docs/peer_llamacpp_w8.json and docs/peer_llamacpp.json (RECORDS; no
    lines while both are missing)."""
    body = [line for name, title, weights in RECORDS for line in record_lines(docs, name, title, weights)]
    return ["## llama.cpp as a peer (`molora bench peer`)", "", *body] if body else []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only say whether docs/benchmarks.md is stale")
    a = p.parse_args(argv)
    from tools import make_benchmarks

    return make_benchmarks.main(["--check"] if a.check else ["--render-only"])


if __name__ == "__main__":
    raise SystemExit(main())
