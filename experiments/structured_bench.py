"""Structured output on the real model: coverage, validity, compile time and throughput on the *test* split.

    python -m experiments.structured_bench [--out docs/structured.json] [--reps 3]

The default bundle (SmolLM2-135M-Instruct with its adapters and learned router: every token routed), fp32,
on the engine (no HTTP). The schemas are the test split of molora/data/schemas/schemas.json (the engine was
chosen on the validation split, experiments/choose_grammar_engine.py); they are scored once, nothing is tuned to them.

  coverage      share of test schemas that compile (molora.structured.StructuredCompiler, xgrammar)
  compile_ms    per schema, first compile (fresh compiler, no cache) and cached (the compiler's LRU): medians
  valid         one greedy answer per compiled schema (chat prompt naming the schema, max 256 new tokens, all in
                one batch): finished / parse as JSON / validate (jsonschema), of all answers and of finished ones;
                flagged: finished answers the answer check (GrammarConstraint.check, the server's
                molora.structured_output_error) reports as breaking the schema; invalid_unflagged must be 0
  strict        the same under OpenAI's strict=true: schemas with keywords xgrammar accepts but does not enforce
                (molora.structured.unenforced) are refused; coverage and validity of the rest (--rescore adds this
                view to an existing record without running the model)
  throughput    decode steps of a full batch, constrained (each request on a test schema, cycled) against
                unconstrained (ignore_eos), batch 1 and 32, greedy: the variants interleave and rotate order every
                repetition; tokens/s = rows / median step time over steps where every row decodes

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
import torch

from molora.config import SamplingParams

SCHEMAS = Path(__file__).resolve().parents[1] / "molora" / "data" / "schemas" / "schemas.json"


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _prompt(tok: Any, s: dict) -> list[int]:
    msg = f"Write one JSON object for this ({s['source']}). Schema: {json.dumps(s['schema'], separators=(',', ':'))}"
    text = tok.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True, tokenize=False)
    return list(tok.encode(text, add_special_tokens=False))


def compile_all(
    tok: Any,
    vocab: int,
    stops: list[int],
    schemas: list[dict],
    max_string_chars: int | None = None,
    max_array_items: int | None = None,
    max_object_properties: int | None = None,
    max_number_digits: int | None = None,
) -> tuple[dict, dict, Any]:
    """(constraints by name, failures by name, the record) compiling each schema first fresh, then cached;
    max_string_chars: the compiler's bound on free strings (molora.schema_rules.bound_runaways; None: the compiler's
    default)."""
    from molora.structured import StructuredCompiler, StructuredOutputError, StructuredSpec

    t0 = time.perf_counter()
    bound = {} if max_string_chars is None else {"max_string_chars": max_string_chars or None}
    bound |= {} if max_array_items is None else {"max_array_items": max_array_items or None}
    bound |= {} if max_object_properties is None else {"max_object_properties": max_object_properties or None}
    bound |= {} if max_number_digits is None else {"max_number_digits": max_number_digits or None}
    compiler = StructuredCompiler(tok, vocab_size=vocab, stop_token_ids=stops, **bound)
    setup_s = time.perf_counter() - t0
    ok, failed, first, cached = {}, {}, [], []
    for s in schemas:
        spec = StructuredSpec.json_schema(s["schema"])
        t0 = time.perf_counter()
        try:
            ok[s["name"]] = compiler.compile(spec)
        except StructuredOutputError as e:
            failed[s["name"]] = str(e)[:300]
            continue
        first.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        compiler.compile(spec)
        cached.append((time.perf_counter() - t0) * 1e3)
    rec = {
        "tokenizer_setup_s": round(setup_s, 3),
        "compiled": len(ok),
        "schemas": len(schemas),
        "coverage": round(len(ok) / len(schemas), 3),
        "failures": failed,
        "compile_ms_first_median": round(statistics.median(first), 2),
        "compile_ms_first_max": round(max(first), 2),
        "compile_ms_cached_median": round(statistics.median(cached), 4),
    }
    return ok, failed, rec


def validity(engine: Any, tok: Any, schemas: list[dict], constraints: dict, max_new: int) -> dict:
    todo = [s for s in schemas if s["name"] in constraints]
    outs = engine.generate(
        [_prompt(tok, s) for s in todo],
        SamplingParams(max_new_tokens=max_new),
        constraint=[constraints[s["name"]] for s in todo],
    )
    rows, finished, parsed, valid, flagged = [], 0, 0, 0, 0
    for s, o in zip(todo, outs):
        text = tok.decode(o.new_token_ids, skip_special_tokens=True)
        row = {"name": s["name"], "finish_reason": o.finish_reason, "tokens": len(o.new_token_ids)}
        finished += o.finish_reason == "stop"
        if o.finish_reason == "stop":  # what the server's answer check reports (molora.structured_output_error)
            row["check"] = constraints[s["name"]].check(text)
            flagged += row["check"] is not None
        try:
            value = json.loads(text)
            parsed += 1
            jsonschema.validators.validator_for(s["schema"])(s["schema"]).validate(value)
            valid += 1
            row["valid"] = True
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            row["valid"], row["why"] = False, f"{type(e).__name__}: {str(e)[:160]}"
        if o.error:
            row["error"] = o.error
        row["text"] = text[:300]
        rows.append(row)
    n = len(todo)
    ended = [r for r in rows if r["finish_reason"] == "stop"]  # a "length" answer is unfinished, even if valid
    valid_ended = sum(r["valid"] for r in ended)
    return {
        "answers": n,
        "finished": finished,
        "parsed": parsed,
        "valid": valid,
        "valid_of_finished": valid_ended,
        "flagged": flagged,
        "invalid_unflagged": sum(not r["valid"] and r["check"] is None for r in ended),
        "valid_share": round(valid / n, 3),
        "valid_share_of_finished": round(valid_ended / max(finished, 1), 3),
        "max_new_tokens": max_new,
        "rows": rows,
    }


def _decode_steps(
    engine: Any, prompts: list[list[int]], params: SamplingParams, constraints: list | None
) -> list[float]:
    """Step times (s) of the steps where every request decodes one token (the full batch, no prefill)."""
    n = len(prompts)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, constraint=None if constraints is None else constraints[i])
    times = []
    while engine.has_unfinished():
        running = len(engine.requests)
        prefill = any(r.num_computed < len(r.tokens) - 1 for r in engine.requests.values())
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        if running == n and not prefill:
            times.append(dt)
    return times


def throughput(
    engine: Any,
    tok: Any,
    schemas: list[dict],
    constraints: dict,
    batch: int,
    reps: int,
    max_new: int,
    short: bool = False,
) -> dict:
    names = [s["name"] for s in schemas if s["name"] in constraints]
    by_name = {s["name"]: s for s in schemas}
    rows = [names[i % len(names)] for i in range(batch)]
    prompts = [_prompt(tok, {**by_name[n], "schema": n} if short else by_name[n]) for n in rows]
    cons = [constraints[n] for n in rows]
    steps: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
    for r in range(reps):
        order = ["unconstrained", "constrained"] if r % 2 == 0 else ["constrained", "unconstrained"]
        for variant in order:
            if variant == "unconstrained":
                t = _decode_steps(engine, prompts, SamplingParams(max_new_tokens=max_new, ignore_eos=True), None)
            else:
                t = _decode_steps(engine, prompts, SamplingParams(max_new_tokens=max_new), cons)
            steps[variant] += t
    med = {k: statistics.median(v) for k, v in steps.items()}
    return {
        "batch": batch,
        "reps": reps,
        "max_new_tokens": max_new,
        "short_prompts": short,
        "steps": {k: len(v) for k, v in steps.items()},
        "step_ms_median": {k: round(v * 1e3, 2) for k, v in med.items()},
        "tokens_per_s": {k: round(batch / v, 1) for k, v in med.items()},
        "constrained_over_unconstrained": round(med["unconstrained"] / med["constrained"], 3),
        "per_token_overhead": round(med["constrained"] / med["unconstrained"] - 1, 3),
    }


def strict_view(schemas: list[dict], comp: dict, valid: dict) -> dict:
    """Coverage and validity if every schema were sent with strict=true (refused: the unenforced ones)."""
    from molora.structured import unenforced

    refused = {s["name"]: unenforced(s["schema"]) for s in schemas if unenforced(s["schema"])}
    kept = [r for r in valid["rows"] if r["name"] not in refused]
    ended = [r for r in kept if r["finish_reason"] == "stop"]
    compiled = comp["compiled"] - len([n for n in refused if n not in comp["failures"]])
    return {
        "refused": refused,
        "compiled": compiled,
        "schemas": len(schemas),
        "coverage": round(compiled / len(schemas), 3),
        "answers": len(kept),
        "finished": len(ended),
        "valid": sum(r["valid"] for r in kept),
        "valid_share_of_finished": round(sum(r["valid"] for r in ended) / max(len(ended), 1), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/structured.json")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=256, help="new tokens per answer in the validity run")
    ap.add_argument("--tput-new", type=int, default=32, help="new tokens per request in the throughput runs")
    ap.add_argument("--rescore", action="store_true", help="only add the strict view to the record at --out")
    ap.add_argument("--skip-validity", action="store_true", help="keep the record's validity, measure the rest")
    ap.add_argument(
        "--split",
        default="test",
        choices=("test", "validation"),
        help="schemas to score (validation: for finding and fixing failures; test: the record)",
    )
    ap.add_argument(
        "--max-string-chars",
        type=int,
        default=None,
        help="bound free strings at this many characters (0: none; default: the compiler's default)",
    )
    ap.add_argument(
        "--max-array-items",
        type=int,
        default=None,
        help="bound arrays without maxItems at this many items (0: none; default: the compiler's default)",
    )
    ap.add_argument(
        "--skip-throughput", action="store_true", help="stop after the validity run (keeps the record's throughput)"
    )
    ap.add_argument(
        "--short-prompts",
        action="store_true",
        help="throughput prompts name the schema without spelling it (less prefill, same decode)",
    )
    args = ap.parse_args()
    if args.rescore:
        record = json.loads(Path(args.out).read_text())
        schemas = [s for s in json.loads(SCHEMAS.read_text())["schemas"] if s["split"] == record["split"]]
        record["strict"] = strict_view(schemas, record["compile"], record["validity"])
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        print(json.dumps({k: v for k, v in record["strict"].items() if k != "refused"}))
        return
    from molora.bundle import load, stop_token_ids
    from molora.engine import Engine, EngineConfig

    schemas = [s for s in json.loads(SCHEMAS.read_text())["schemas"] if s["split"] == args.split]
    mm = load()
    tok = mm.tokenizer
    vocab = int(mm.model.config.vocab_size)
    stops = stop_token_ids(tok, mm.bundle)
    constraints, _, comp = compile_all(tok, vocab, stops, schemas, args.max_string_chars, args.max_array_items)
    print(json.dumps({k: v for k, v in comp.items() if k != "failures"}), flush=True)
    engine = Engine(mm, EngineConfig(max_num_seqs=32, max_model_len=2048, kv_budget_tokens=32 * 1024))
    out = Path(args.out)
    old = json.loads(out.read_text()) if out.exists() else {}
    record = {
        "split": args.split,
        "model": "SmolLM2-135M-Instruct (default bundle, learned routing)",
        "dtype": "fp32",
        "grammar_engine": f"xgrammar {_version('xgrammar')}",
        "cpu": _cpu(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "load_avg_start": [round(x, 2) for x in os.getloadavg()],
        "command": " ".join(["python -m experiments.structured_bench"] + sys.argv[1:]),
        "compile": comp,
    }
    try:
        if args.skip_validity:
            record["validity"] = old["validity"]
            record["validity_command"] = old.get("validity_command", old["command"])  # the run that measured it
        else:
            record["validity"] = validity(engine, tok, schemas, constraints, args.max_new)
            out.write_text(json.dumps(record, indent=1) + "\n")  # a later phase may be stopped
        valid = record["validity"]
        print(json.dumps({k: v for k, v in valid.items() if k != "rows"}), flush=True)
        record["strict"] = strict_view(schemas, comp, valid) if "rows" in valid else None
        tput = []
        if args.skip_throughput and "throughput" in old:  # kept as measured, with the run that measured it
            record["throughput"] = old["throughput"]
            record["throughput_command"] = old.get("throughput_command", old["command"])
            record["throughput_load_avg"] = old.get("throughput_load_avg", [old["load_avg_start"], old["load_avg_end"]])
        for b in () if args.skip_throughput else (1, 32):
            tput.append(throughput(engine, tok, schemas, constraints, b, args.reps, args.tput_new, args.short_prompts))
            print(json.dumps(tput[-1]), flush=True)
            record["throughput"] = tput
            out.write_text(json.dumps(record, indent=1) + "\n")
    finally:
        engine.close()
        record["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
        if "validity" in record:  # a run stopped before its first phase leaves the old record alone
            out.write_text(json.dumps(record, indent=1) + "\n")
    print(
        json.dumps(
            {
                "coverage": comp["coverage"],
                "valid_share": valid["valid_share"],
                "b1_overhead": tput[0]["per_token_overhead"] if tput else None,
                "b32_ratio": tput[1]["constrained_over_unconstrained"] if tput else None,
            }
        )
    )


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    main()
