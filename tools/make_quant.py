"""The quantized-base section of docs/benchmarks.md from its records (docs/quant*.json).

    python -m tools.make_quant [--check]       # = tools/make_benchmarks.py --render-only (or --check)

docs/quant_linear.json comes from `experiments/ab_quant_linear.py --json docs/quant_linear.json` (the kernels on
SmolLM2-135M's linear shapes), docs/quant.json from `experiments/bench_quant.py --json docs/quant.json` (the engine on
the real model), docs/quant_smooth_choice.json from `experiments/quant_smooth_choose.py`,
docs/quant_eval_{val,test}[_w8].json from `experiments/quant_eval.py --split val|test` (without _w8: made when int8
meant W8A8). `section` renders the lines; tools/make_benchmarks.py, which renders the whole page, places them.
This script measures nothing.
"""

from __future__ import annotations

import argparse
import json
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


# What a record from before bench_quant wrote its "schemes" meant by int8 (then W8A8; now the scheme w8a8)
OLD_SCHEMES = (
    "int8 is W8A8 on oneDNN (weights per output channel, activations rounded per token after SmoothQuant's "
    "per-channel factors); int4 is weight only on torch's kernel, groups of 32 (molora.ops.quant)."
)


def section(docs: Path) -> list[str]:
    """The "Quantized base" section of docs/benchmarks.md from docs/quant.json and docs/quant_linear.json (no lines
    while either record is missing). tools/make_benchmarks.py places it on the page it renders."""
    if not ((docs / "quant.json").is_file() and (docs / "quant_linear.json").is_file()):
        return []
    lin = json.loads((docs / "quant_linear.json").read_text())
    eng = json.loads((docs / "quant.json").read_text())
    m = eng["machine"]
    head = (
        f"Measured on {m['cpu']} ({', '.join(m['cpu_flags'] + m['int8_flags'])}), {m['cores']} cores shared "
        f"with other work (load average {m['loadavg_1_5_15']} at the engine run), {m['threads']} thread(s): read "
        f"the ratios, not the absolute figures. {eng.get('schemes', OLD_SCHEMES)} Records: "
        "`experiments/bench_quant.py --json docs/quant.json`, `experiments/ab_quant_linear.py --json "
        "docs/quant_linear.json`; rendered by `tools/make_quant.py`. The older engine records "
        "(all but docs/quant_w8a8_*.json) timed repetitions of the same prompts with the engine's prefix cache on, "
        "so a repetition skipped up to three quarters of its prefill (molora.bench.engine.bench_config); their "
        "ratios compare variants that all had it."
    )
    return [
        "## Quantized base (`--quantization int8|int4`)",
        "",
        head,
        "",
        *engine_table(eng),
        "",
        *other_cpu_lines(docs),
        *w8a8_lines(docs),
        *kernel_table(lin),
        "",
        *onecopy_lines(docs),
        *resident_lines(docs),
        *head_lines(docs),
        *quality_lines(docs),
    ]


def other_cpu_lines(docs: Path) -> list[str]:
    """The same engine bench on a CPU without AMX (docs/quant_noamx.json), where the record exists."""
    path = docs / "quant_noamx.json"
    if not path.is_file():
        return []
    r = json.loads(path.read_text())
    m = r["machine"]
    return [
        f"The same bench on {m['cpu']} ({', '.join(m['cpu_flags'] + m['int8_flags'])}; no AMX: int8 with bfloat16 "
        "activations runs molora's int8 kernel on rows, bfloat16 weights are not packed), nothing else running "
        f"(load average {m['loadavg_1_5_15']}), {m['threads']} thread(s), record docs/quant_noamx.json "
        f"(`{r['command']}`):",
        "",
        *engine_table(r),
        "",
    ]


def resident_lines(docs: Path) -> list[str]:
    """Every resident copy of the base weights per variant against llama.cpp's files (docs/quant_weight_bytes.json,
    experiments/quant_weight_bytes.py, and the earlier AMX machine's docs/quant_weight_bytes_amx.json), where the
    records exist."""
    out: list[str] = []
    for fname in ("quant_weight_bytes.json", "quant_weight_bytes_amx.json"):
        path = docs / fname
        if path.is_file():
            out += resident_table(json.loads(path.read_text()), fname)
    return out


def resident_table(r: dict, fname: str) -> list[str]:
    m = r.get("machine")
    where = (
        f"{m['cpu']} ({', '.join(m['cpu_flags'])}; "
        + ("AMX on" if m["amx"] else "no AMX: bfloat16 weights are not packed")
        + ")"
        if m
        else "an AMX CPU (the record names none; its bfloat16 packed copies exist only where AMX runs)"
    )
    src = r.get("gguf_peer_from")
    files = (
        f" (llama.cpp file sizes from {src['record']}: the peer bench's files are not on this machine)" if src else ""
    )
    out = [
        f"Resident base weights on {where}, every copy counted once (docs/{fname}: `{r['command']}`: after a short "
        "generate, so the kernels' copies exist; quantized: int8/int4 weights and scales as kept; float: embeddings "
        "with the tied LM head, norms, float base linears; kernel copies: the runner's packed copies of float "
        "weights, the LM head's where it stays float, int8's float32 scales, w8a8's oneDNN copy; head: the tied LM "
        "head and the embeddings in int8, one copy, `quantize_lm_head`), MB, against the llama.cpp file of the same "
        f"type{files} (the shipped {r['gguf_shipped']['file']}: {r['gguf_shipped']['bytes'] / 1e6:.1f} MB):",
        "",
        "| variant | head | quantized | float | kernel copies | total | GGUF | total / GGUF "
        "| without kernel copies / GGUF |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for name, v in r["variants"].items():
        b, g = v["bytes"], v.get("gguf")
        gg = f"{g} {r['gguf_peer'][g] / 1e6:.1f}" if g else "-"
        ratio = f"{v['total_over_gguf']:.2f}x | {v['without_kernel_copies_over_gguf']:.2f}x" if g else "- | -"
        head = "int8" if v.get("lm_head_int8") else "float"
        out.append(
            f"| {name} | {head} | {b['quantized'] / 1e6:.1f} | {b['float'] / 1e6:.1f} | "
            f"{b['kernel_copies'] / 1e6:.1f} | {v['total'] / 1e6:.1f} | {gg} | {ratio} |"
        )
    return [*out, ""]


def ab_cells(r: dict, mark_tokens: bool = False) -> str:
    """An ab_engine_trees record's workloads as "name median x [quartiles]" (paired time ratios, head over base),
    with "(tokens differ)" where the two trees' greedy tokens differed and mark_tokens is set."""
    cells = []
    for k, v in r["workloads"].items():
        med, lo, hi = v["head_over_base_paired"][:3]
        differ = mark_tokens and v["same_tokens"] is False
        cells.append(f"{k} {med:.3f}x [{lo:.3f}-{hi:.3f}]" + (" (tokens differ)" if differ else ""))
    return "; ".join(cells)


def onecopy_lines(docs: Path) -> list[str]:
    """The one-int8-copy change against the two copies before it, paired both ways round (ab_engine_trees on an
    int8 base: docs/quant_w8_onecopy_ab.json, head = one copy; docs/quant_w8_onecopy_ab_swapped.json, head = two),
    where the records exist."""
    runs = []
    for name, head in (
        ("quant_w8_onecopy_ab.json", "one copy / two"),
        ("quant_w8_onecopy_ab_swapped.json", "two / one"),
    ):
        path = docs / name
        if not path.is_file():
            continue
        r = json.loads(path.read_text())
        m = r["machine"]
        cells = ab_cells(r, mark_tokens=True)
        same = all(v["same_tokens"] is not False for v in r["workloads"].values())
        runs.append(
            f"time {head} (`{r['command']}`, {r['repeats']} repetitions, {m['threads']} thread, load average "
            f"{m['loadavg_before']} before): {cells}" + ("; the same greedy tokens" if same else "")
        )
    if not runs:
        return []
    return [
        "One int8 copy: a bfloat16 int8 base keeps its weight only in the AMX tiles' layout (prefill and decode "
        "read the tiles), where it kept the rows and a tiled copy before (about 106 MB more for SmolLM2-135M). "
        "Paired, the tree before the change against the tree after, both ways round (float32 activations read the "
        "rows in both trees: a control for what the two processes differ by): " + ". ".join(runs) + ".",
        "",
    ]


def head_lines(docs: Path) -> list[str]:
    """The LM head in int8 against float, timed: the engine bench's workloads on two trees that differ only in that
    default (ab_engine_trees, docs/quant_head_ab.json) and bench_quant's variants in one process
    (docs/quant_head_bench.json; paired: the ratio within each repetition), where the records exist."""
    parts = []
    for fname, what in (
        ("quant_head_ab.json", "time with the head in int8 over time with it in float"),
        ("quant_head_ab_swapped.json", "the same trees the other way round, time with it in float over int8"),
    ):
        path = docs / fname
        if not path.is_file():
            continue
        r = json.loads(path.read_text())
        m = r["machine"]
        cells = ab_cells(r)
        parts.append(
            f"{what}, two trees differing only in that default (`{r['command']}`, {m['cpu']}, {r['repeats']} "
            f"repetitions, {m['threads']} thread, load average {m['loadavg_before']} before; median [quartiles] of "
            f"the paired ratios): {cells}"
        )
    path = docs / "quant_head_bench.json"
    if path.is_file():
        r = json.loads(path.read_text())
        v = r["variants"]
        cells = []
        for q, f in (("int8-qhead", "int8-fhead"), ("int8-bf16-qhead", "int8-bf16-fhead")):
            if q in v and f in v:
                ratios = sorted(a / b for a, b in zip(v[q]["samples_s"], v[f]["samples_s"]))
                n = len(ratios)
                cells.append(f"{q} / {f} {ratios[n // 2]:.3f}x [{ratios[n // 4]:.3f}-{ratios[(3 * n) // 4]:.3f}]")
        parts.append(
            f"`{r['command']}` ({r['machine']['cpu']}, load average {r['machine']['loadavg_1_5_15']} before, "
            f"{r['loadavg_after']} after; time ratio within each repetition, median [quartiles]): " + "; ".join(cells)
        )
    if not parts:
        return []
    return ["The LM head in int8, timed: " + ". ".join(parts) + ".", ""]


def quality_lines(docs: Path) -> list[str]:
    """The smoothing choice (docs/quant_smooth_choice.json) and the skill / retention tables (EVAL_RECORDS), each
    where its record exists."""
    out = []
    path = docs / "quant_gguf.json"
    if path.is_file():
        g = json.loads(path.read_text())
        i4, i8 = g["schemes"]["int4"], g["schemes"]["int8"]
        out += [
            "GGUF weights (`experiments/quant_gguf_requant.py --json docs/quant_gguf.json`): the embedded "
            f"{g['gguf']} holds "
            f"its {g['linears']} block linears as Q4_1 (groups of 32 along the input, a float16 scale and minimum "
            "each). molora loads them as floats and quantizes again on load; int4 (groups of 32, min/max) gives back "
            f"{i4['exact_share']:.1%} of the GGUF's weights exactly (largest difference {i4['max_rel_diff']:.1e} of "
            "a linear's largest weight): Q4_1 and torch's int4 layout are the same grid, so re-quantizing costs "
            "nothing here and keeps one path for every source (GGUF, safetensors). int8 (one scale per output "
            f"channel) moves weights by up to {i8['max_rel_diff']:.2%} of a linear's largest weight.",
            "",
        ]
    path = docs / "quant_smooth_choice.json"
    if path.is_file():
        c = json.loads(path.read_text())
        cells = "; ".join(
            f"{k} {v['top1_agreement']:.1%} / {v['kl_per_position']:.4f}" for k, v in c["variants"].items()
        )
        out += [
            f"int8's SmoothQuant strength, chosen on validation text (`{c['command']}`: {c['rows']} general prompts "
            f"with answers, {c['positions']} positions, teacher forced; top-1 agreement with fp32 / KL per "
            f"position): {cells}. Chosen: alpha = {c['chosen_alpha']}.",
            "",
        ]
    for fname, split, old in EVAL_RECORDS:
        path = docs / fname
        if path.is_file():
            out += eval_table(json.loads(path.read_text()), split, old)
    return out + retention_lines(docs) + keep_lines(docs)


KEEP_RECORDS = ("quant_w8a8_keep_val.json", "quant_w8a8_down_alpha_val.json")  # experiments/w8a8_keep_probe.py


def keep_lines(docs: Path) -> list[str]:
    """Where w8a8 loses against float32, by projection (experiments/w8a8_keep_probe.py, validation), where recorded."""
    out: list[str] = []
    for fname in KEEP_RECORDS:
        found = newest(docs, fname)
        if not found:
            continue
        r = found[0]
        sets = list(next(iter(r["variants"].values())))
        out += [
            f"Where w8a8 loses, by projection (`{r['command']}` on {r['date']}, {r['machine']['cpu']}; validation: "
            f"{r['n']} arithmetic items on the arithmetic adapter and {r['n']} general prompts on the base model, "
            f"float32's greedy answers read back teacher-forced; top-1 = the share of answer positions whose argmax "
            "is float32's token, KL = mean KL(float32 || variant) per position; keep X = w8a8 with the projections X "
            "in weight-only int8; not a served option, nothing scored on test):",
            "",
            "| variant | " + " | ".join(f"{k} top-1 | {k} KL" for k in sets) + " |",
            "|---|" + "---:|" * (2 * len(sets)),
            *[
                f"| {n} | "
                + " | ".join(f"{v[k]['top1_agreement']:.4f} | {v[k]['kl_per_position']:.5f}" for k in sets)
                + " |"
                for n, v in r["variants"].items()
            ],
            "",
        ]
    return out


RETENTION_RECORD = "quant_retention_test2.json"  # experiments/quant_retention.py: retention taken apart
RETENTION_BEFORE = "quant_retention_test2_merged.json"  # the same, before prefill merging went off
RETENTION_MORE = "quant_retention_test2_int8bf16.json"  # the int8-bf16 variants, same command and prompts


def retention_lines(docs: Path) -> list[str]:
    """The retention decompositions (experiments/quant_retention.py) as tables, where their records exist."""
    out: list[str] = []
    for name in (RETENTION_RECORD, RETENTION_MORE, RETENTION_BEFORE):
        found = newest(docs, name)
        if found:
            out += _retention_table(found[0])
    return out


def _retention_table(r: dict) -> list[str]:
    m = r["machine"]
    return [
        f"General retention taken apart (`{r['command']}` on {r['date']}, {m['cpu']}, {m['threads']} thread(s); "
        f"the {r['n_general']} general prompts of the {r['split']} rows above; nothing chosen): engine = the tables' "
        "retention again (routed run, then base run, in one engine as served); adapter tokens = answer tokens the "
        "routed run computed on an adapter (0: the router kept every general prompt wholly on the base model); "
        "base again = the base run repeated in a fresh engine, prefix cache off, prompts in reverse order, equal "
        "to the first base run (how far the base's own answers move with the batch beside them); same batches = "
        "retention with routed and base answered in identical batches (molora.eval.general), so that the batch "
        "cannot differ" + (f" (note: {r['note']})" if r.get("note") else "") + ":",
        "",
        "| variant | engine retention | adapter tokens (of answer tokens) | base again = base | same batches |",
        "|---|---:|---:|---:|---:|",
        *[
            f"| {n} | {v['engine_retention']:.1f}% | {v['engine_adapter_tokens']} of {v['engine_routed_tokens']} | "
            f"{v['engine_base_repeat']:.1f}% | {v['same_batches_retention']:.1f}% |"
            for n, v in r["variants"].items()
        ],
        "",
    ]


PEER_QHEAD = "peer_llamacpp_qhead.json"  # molora bench peer with int8-qhead


def peer_goal_cell(docs: Path) -> str | None:
    """The peer goals read off the int8-qhead peer record, where it exists: molora >= 1.0x llama.cpp's
    Q8_0 without adapters and >= 1.3x with one LoRA, its resident weights within 1.5x of the GGUF's bytes."""
    found = newest(docs, PEER_QHEAD)
    if not found:
        return None
    r = found[0]
    cells = []
    for n, v in r["variants"].items():
        plain, lora = v["llama_over_molora"][0], v["llama_over_molora_lora"][0]
        size = v["molora"]["weight_bytes"] / v["llama.cpp"]["file_bytes"]
        met = plain >= 1.0 and lora >= 1.3 and size <= 1.5
        cells.append(
            f"{n} vs {v['llama.cpp']['gguf_type']} {plain:.2f}x ({lora:.2f}x with a LoRA; weights {size:.2f}x the "
            f"GGUF's: the three peer goals {'met' if met else 'not all met'})"
        )
    return (
        f"the same peer bench with the LM head in int8 ({r['llama_cpp']['n_threads']} thread(s), on "
        f"{r['machine']['cpu']}, prefix cache off): " + ", ".join(cells)
    )


def _retention_records(docs: Path) -> list[dict]:
    """The retention decompositions since prefill merging went off (RETENTION_RECORD, RETENTION_MORE) that exist."""
    return [found[0] for name in (RETENTION_RECORD, RETENTION_MORE) if (found := newest(docs, name))]


def _is_noise(v: dict) -> bool:
    """Whether a variant's retention decomposition says its engine retention loss is not the router's: no answer
    token on an adapter, and full retention where routed and base run in identical batches."""
    return v["engine_adapter_tokens"] == 0 and v["same_batches_retention"] >= 95.0


def retention_cell(docs: Path) -> str | None:
    """The README's one-line reading of the retention decompositions, where their records exist."""
    recs = _retention_records(docs)
    if not recs:
        return None
    v = {n: x for r in recs for n, x in r["variants"].items()}
    of = " and ".join(sorted({f"the same {r['n_general']} general prompts of {r['split']}" for r in recs}))
    noise = [n for n, x in v.items() if x["engine_retention"] < 100 and _is_noise(x)]
    return (
        f"taken apart on {of} (engine retention / answer tokens on an "
        "adapter / the base's own answers repeated in another batch / retention in identical batches): "
        + ", ".join(
            f"{n} {x['engine_retention']:.0f}% / {x['engine_adapter_tokens']} / {x['engine_base_repeat']:.0f}% / "
            f"{x['same_batches_retention']:.0f}%"
            for n, x in v.items()
        )
        + (
            f"; below 100% ({', '.join(noise)}) is the base's own answers moving with the batch, not routing"
            if noise
            else ""
        )
    )


def eval_table(e: dict, split: str, old: bool) -> list[str]:
    """One quant_eval record as a table: accuracy per skill (its difference from fp32, with the paired 95% interval
    where the record has the items' hits), retention (with Wilson's 95% interval where recorded), base = fp32."""
    tasks = list(next(iter(e["variants"].values()))["skills"])
    era = " (W8A8 era: its int8 is the old W8A8 path, now `--quantization w8a8`)" if old else ""
    m = e["machine"]
    cpu = f", {m['cpu']}" if "cpu_flags" in m else ""  # older records named only the architecture
    ci = any("skills_vs_fp32_ci95" in v for n, v in e["variants"].items() if n != "fp32")
    out = [
        f"Skills and general retention on a quantized base, {split} split{era} (`{e['command']}`; bundle "
        f"{e['fingerprint']}{cpu}, learned routing, greedy; {e['n']} items per skill, {e['n_general']} general "
        "prompts; retention: answers equal to the same model's own answer without adapters; base = fp32: its "
        "answer without adapters equal to fp32's"
        + (
            "; in brackets the 95% interval on the difference from fp32 over the same items (paired) and on the "
            "retention (Wilson)"
            if ci
            else ""
        )
        + (f"; fp32: the run of {e['fp32_from']['record']}" if "fp32_from" in e else "")
        + (
            "; the skill items are fresh (molora.eval.heldout: none of val's or test's), the general prompts are the "
            "test split's (no other general prompts are left; no setting was chosen on them)"
            if e["split"] == "test2"
            else ""
        )
        + "):",
        "",
        "| variant | " + " | ".join(tasks) + " | retention | base = fp32 |",
        "|---|" + "---:|" * (len(tasks) + 2),
    ]
    for name, v in e["variants"].items():
        d, w = v.get("skills_vs_fp32", {}), v.get("skills_vs_fp32_ci95", {})
        cells = []
        for t in tasks:
            cell = f"{v['skills'][t]:.1f}"
            if name != "fp32" and t in d:
                cell += f" ({d[t]:+.1f}" + (f" [{w[t][0]:+.1f}, {w[t][1]:+.1f}]" if t in w else "") + ")"
            cells.append(cell)
        g = v["general"]
        same, r = g.get("base_equal_to_fp32_base"), g.get("retention_ci95")
        ret = f"{g['retention']:.1f}%" + (f" [{r[0]:.1f}, {r[1]:.1f}]" if r else "")
        out.append(f"| {name} | " + " | ".join(cells) + f" | {ret} | {'-' if same is None else f'{same:.1f}%'} |")
    if ci:
        widest = max(
            (hi - lo) / 2
            for n, v in e["variants"].items()
            if n != "fp32" and "skills_vs_fp32_ci95" in v
            for lo, hi in v["skills_vs_fp32_ci95"].values()
        )
        ref = e["variants"].get("fp32") or e.get("reference_fp32")
        disc = max(
            sum(x != y for x, y in zip(v["hits"][t], ref["hits"][t])) / len(ref["hits"][t])
            for n, v in e["variants"].items()
            if n != "fp32" and "hits" in v
            for t in tasks
        )
        out += [
            "",
            f"At {e['n']} items per skill the widest of these intervals reaches +-{widest:.1f} points around its "
            "difference: a 1-point goal is " + ("resolvable" if widest <= 1 else "not resolvable") + " here. At most "
            f"{disc:.0%} of a skill's items change their score between fp32 and a variant; at that share an interval "
            f"of +-1 point needs about {1.96**2 * disc / 0.01**2:.0f} items per skill (1.96^2 x share / 0.01^2).",
        ]
    return [*out, ""]


# The quality records (file, split, made when int8 meant W8A8), oldest first: the weight-only int8's have "_w8"
EVAL_RECORDS = (
    ("quant_eval_val.json", "val", True),
    ("quant_eval_test.json", "test", True),
    ("quant_eval_val_w8.json", "val", False),
    ("quant_eval_test_w8.json", "test", False),
    ("quant_eval_val_head.json", "val (the LM head: float against int8)", False),
    ("quant_eval_test2.json", "test2 (fresh, larger)", False),
    ("quant_eval_test2_bf16.json", "test2 (fresh, larger; the int8-bf16 variants, a second process)", False),
    ("quant_eval_val_w8a8_head.json", "val (w8a8 on torch._int_mm, and its LM head in w8a8 too)", False),
    ("quant_eval_test2_w8a8.json", "test2 (fresh, larger; w8a8 on torch._int_mm, a third process)", False),
)


def label(rec: dict, name: str, old: bool | None = None) -> str:
    """A variant's name as the README shows it: "int8" in a record made before int8 became weight only (old; by
    default: no "schemes" field) was W8A8, which is `--quantization w8a8` now."""
    old = "schemes" not in rec if old is None else old
    return f"{name} (W8A8, now w8a8)" if name.startswith("int8") and old else name


def newest(docs: Path, *names: str) -> tuple[dict, bool] | None:
    """The first of the records `names` that exists (newest first), and whether it is the W8A8 era's (the last name of
    two or more), or None."""
    for i, n in enumerate(names):
        if (docs / n).is_file():
            return json.loads((docs / n).read_text()), len(names) > 1 and i == len(names) - 1
    return None


W8A8_ENGINE = (  # the engine bench for --quantization w8a8 on torch._int_mm, prefix cache off
    ("quant_w8a8_noamx.json", "the engine bench's workload"),
    ("quant_w8a8_noamx_prefill.json", "long prompts, few new tokens (prefill-heavy)"),
    ("quant_w8a8_head_noamx.json", "with the LM head in w8a8 too (w8a8-qhead: memory, not speed)"),
    (
        "quant_w8a8_keepdown_noamx.json",
        "with down_proj in weight-only int8 (w8a8-keepdown, a bench-only variant: the projection behind half of "
        "w8a8's arithmetic KL on validation, see below)",
    ),
)


def w8a8_lines(docs: Path) -> list[str]:
    """`--quantization w8a8` on torch._int_mm with molora's rounding and scaling kernels: the engine bench
    (W8A8_ENGINE) and the linear's A/B (docs/quant_w8a8_kernel.json), where the records exist."""
    out: list[str] = []
    for fname, what in W8A8_ENGINE:
        path = docs / fname
        if not path.is_file():
            continue
        r = json.loads(path.read_text())
        m = r["machine"]
        out += [
            f"W8A8 on torch._int_mm, {what}, prefix cache off, on {m['cpu']} "
            f"({', '.join(m['cpu_flags'] + m['int8_flags'])}), load average {m['loadavg_1_5_15']}, "
            f"{m['threads']} thread(s), record docs/{fname} (`{r['command']}`):",
            "",
            *engine_table(r),
            "",
        ]
    path = docs / "quant_w8a8_kernel.json"
    if path.is_file():
        r = json.loads(path.read_text())
        m = r["machine"]
        out += [
            f"W8A8's linear alone on SmolLM2-135M's shapes, {r['unit']}, {m['cpu']} ({', '.join(m['cpu_flags'])}), "
            f"{m['threads']} thread(s), medians of {r['repeats']} interleaved repetitions (`{r['command']}`, "
            "docs/quant_w8a8_kernel.json): w8a8 = what `--quantization w8a8` runs (molora's rounding and scaling "
            "kernels around torch._int_mm), torch ops = the same arithmetic in torch ops, oneDNN s8 = what it ran "
            "before (oneDNN's qlinear on signed int8 activations), fp32 = molora's float32 panels GEMM:",
            "",
            "| rows | shape (N x K) | w8a8 us | torch ops us | oneDNN s8 us | fp32 us | fp32 / w8a8 |",
            "|---:|---|---:|---:|---:|---:|---:|",
        ]
        for c in r["cells"]:
            one = f"{c['onednn_s8']:.0f}" if "onednn_s8" in c else "-"
            out.append(
                f"| {c['rows']} | {c['shape']} ({c['n']} x {c['k']}) | {c['w8a8']:.1f} | {c['w8a8_torch_ops']:.1f} | "
                f"{one} | {c['fp32_panels']:.1f} | {c['fp32_over_w8a8']:.2f}x |"
            )
        out.append("")
    return out


def readme_block(docs: Path, page: str) -> str:
    """The README's quantized-base block (QUANT_BEGIN ... QUANT_END): one bullet with a sub-bullet per question a
    user asks (speed, memory, against llama.cpp, quality, general retention), each from its records where they
    exist (the older 24-item test split and the other per-record detail stay in docs/benchmarks.md); page: the link
    to docs/benchmarks.md relative to the README."""
    from molora.docblock import markers

    begin, end = markers("quant", "tools/make_quant.py")
    parts = [p for p in (_speed_cell(docs), _memory_cell(docs), _peer_cell(docs), _quality_cell(docs)) if p]
    cell = retention_cell(docs)
    if cell:
        parts.append(("General retention", cell))
    head = (
        "- **Quantized base** (`--quantization int8|int4|w8a8`, "
        f"[details]({page}#quantized-base---quantization-int8int4))"
    )
    body = (
        head + ":\n" + "\n".join(f"  - **{t}**: {x}." for t, x in parts)
        if parts
        else "- **Quantized base**: no record yet."
    )
    return f"{begin}\n{body}\n{end}"


def _speed_cell(docs: Path) -> tuple[str, str] | None:
    """The engine bench against float32 per CPU: docs/quant.json (AMX), docs/quant_noamx.json and the w8a8 records."""
    cells = []
    for fname in ("quant.json", "quant_noamx.json"):
        if (docs / fname).is_file():
            e = json.loads((docs / fname).read_text())
            v = e["variants"]
            amx = "AMX" if any(f.startswith("amx") for f in e["machine"].get("cpu_flags", [])) else "no AMX"
            cells.append(
                f"{e['machine']['cpu']} ({amx}; {e['requests']} requests, per-token routing over 4 adapters, "
                f"{e['machine']['threads']} threads, prefix cache on in every variant): "
                + ", ".join(f"{label(e, n)} {v[n]['vs_fp32']:.2f}x" for n in v if n != "fp32")
            )
    w8 = [json.loads((docs / f).read_text()) for f, _ in W8A8_ENGINE[:2] if (docs / f).is_file()]
    if w8:
        cells.append(
            f"w8a8 on torch._int_mm on {w8[0]['machine']['cpu']} (prefix cache off): "
            + ", ".join(
                f"{r['variants']['w8a8']['vs_fp32']:.2f}x ({r['requests']} x ({r['prompt_len']} prompt + "
                f"{r['new_tokens']} new))"
                for r in w8
            )
        )
    return ("Speed against float32", "; ".join(cells)) if cells else None


def _memory_cell(docs: Path) -> tuple[str, str] | None:
    """Every resident copy of the base weights (docs/quant_weight_bytes.json) against the GGUF files."""
    if not (docs / "quant_weight_bytes.json").is_file():
        return None
    w = json.loads((docs / "quant_weight_bytes.json").read_text())
    sizes = ", ".join(
        f"{n} {x['total'] / 1e6:.0f}" + (f" ({x['total_over_gguf']:.2f}x its {x['gguf']})" if "gguf" in x else "")
        for n, x in w["variants"].items()
    )
    cpu = f" on {w['machine']['cpu']}" if "machine" in w else ""
    return ("Memory", f"resident base weights MB{cpu}, every copy (the kernels' packed copies included): {sizes}")


def _peer_cell(docs: Path) -> tuple[str, str] | None:
    """llama.cpp's time over molora's (docs/peer_llamacpp_nocache.json, else the older records) and the int8-qhead
    peer record with the peer goals."""
    cells = []
    peer = ("peer_llamacpp_nocache.json", "peer_llamacpp_w8.json", "peer_llamacpp.json")  # newest first
    found = newest(docs, *peer)
    if found:
        r, old = found
        cached = not (docs / peer[0]).is_file()  # the older records timed molora with its prefix cache on
        how = "molora's prefix cache on: repetitions partly hit it" if cached else "molora's prefix cache off"
        cells.append(
            f"{r['llama_cpp']['n_threads']} thread(s) on {r['machine']['cpu']}, {how}: "
            + ", ".join(
                f"{label(r, n, old)} vs {v['llama.cpp']['gguf_type']} {v['llama_over_molora'][0]:.2f}x "
                f"({v['llama_over_molora_lora'][0]:.2f}x with a LoRA)"
                for n, v in r["variants"].items()
            )
        )
    qhead = peer_goal_cell(docs)
    if qhead:
        cells.append(qhead)
    return ("llama.cpp's time over molora's, same prompts", "; ".join(cells)) if cells else None


def _quality_cell(docs: Path) -> tuple[str, str] | None:
    """The skills on the fresh test2 split against float32, paired 95% intervals (docs/quant_eval_test2*.json)."""
    rows, n_items = [], None
    for fname in ("quant_eval_test2.json", "quant_eval_test2_bf16.json", "quant_eval_test2_w8a8.json"):
        if (docs / fname).is_file():
            q = json.loads((docs / fname).read_text())
            n_items = q["n"]
            rows += [
                f"{n} "
                + ", ".join(
                    f"{t} {x:+.0f} [{v['skills_vs_fp32_ci95'][t][0]:+.1f}, {v['skills_vs_fp32_ci95'][t][1]:+.1f}]"
                    for t, x in v["skills_vs_fp32"].items()
                )
                for n, v in q["variants"].items()
                if n != "fp32" and "skills_vs_fp32" in v
            ]
    if not rows:
        return None
    return (
        "Skills against float32",
        f"learned routing on the fresh test2 split, {n_items} items per skill, points with the paired 95% interval: "
        + "; ".join(rows),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only say whether docs/benchmarks.md is stale")
    a = p.parse_args(argv)
    from tools import make_benchmarks

    return make_benchmarks.main(["--check"] if a.check else ["--render-only"])


if __name__ == "__main__":
    raise SystemExit(main())
