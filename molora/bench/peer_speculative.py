"""Speculative decoding beside llama.cpp's prompt lookup: batch 1, greedy, one LoRA, the same real prompts.

    molora bench peer --speculative JSON [--items 2] [--new-tokens 64] [--repeats 3] [--threads 1]
        [--adapter NAME] [--cache DIR] [--json OUT]

JSON is vLLM's speculative config as the engine takes it (method "ngram"). Prompts: the speculative bench's
(molora.bench.speculative.prompts: `--items` prompts of each of the default bundle's four skills and as many general
chat prompts, in the bundle's template), token ids fed to both systems. Each prompt runs alone, greedy, on one LoRA of
the default bundle (`--adapter`, default its first), up to `--new-tokens` new ids or the bundle's stop ids, whichever
comes first, on four systems, their order rotating prompt by prompt:

    molora          Engine.generate pinned to the adapter, no drafts
    molora_spec     the same with the speculative config (prompt lookup, verified in one forward)
    llama.cpp       llama-cpp-python's `Llama` (F32 GGUF of molora's own weights, the adapter as a GGUF LoRA on the
                    context), `Llama.generate` with the greedy sampler
    llama.cpp_spec  the same `Llama` with `draft_model=LlamaPromptLookupDecoding(max_ngram_size=prompt_lookup_max,
                    num_pred_tokens=num_speculative_tokens)`: llama-cpp-python's prompt lookup (its drafts: the ids
                    after the *first* earlier occurrence of the longest recurring suffix; every row's logits kept)

The whole round is repeated `--repeats` times. Recorded per group (skills, chat): each system's tokens/s per round and
their median, the per-round paired ratios (each system's time over molora's plain time, and llama.cpp_spec over
molora_spec), molora's ids per verified chunk, and greedy agreement of each system with molora plain. Ends with one
JSON line. Owns timing and reporting only; llama.cpp is reached through molora.bench.peer's loaders.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from molora.bench.common import machine_info, rotated, stderr_log

SYSTEMS = ("molora", "molora_spec", "llama.cpp", "llama.cpp_spec")


class LlamaCppGreedy:
    """llama-cpp-python's high-level `Llama` on one GGUF with one LoRA, greedy, one prompt at a time; with
    `draft` its prompt-lookup speculative decoding."""

    def __init__(self, llama: ModuleType, gguf: Path, lora: Path, n_ctx: int, threads: int, draft: Any = None):
        self.llm = llama.Llama(
            model_path=str(gguf),
            lora_path=str(lora),
            n_ctx=n_ctx,
            n_batch=512,
            n_threads=threads,
            n_threads_batch=threads,
            n_gpu_layers=0,
            draft_model=draft,
            verbose=False,
        )

    def generate(self, prompt: list[int], new_tokens: int, stops: set[int]) -> list[int]:
        """Greedy ids after `prompt` (its KV computed afresh: no prefix kept from the previous prompt), up to
        new_tokens or a stop id (kept, as the engine keeps it)."""
        self.llm.reset()  # n_tokens 0 and the KV memory cleared: generate() then reuses no prefix
        out: list[int] = []
        for tok in self.llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            out.append(int(tok))
            if len(out) >= new_tokens or tok in stops:
                break
        return out


def _agreement(ref: list[list[int]], out: list[list[int]]) -> float:
    from molora.bench.peer import agreement

    return round(agreement(ref, out), 4)


def run(llama: ModuleType, spec_json: str, items: int, new_tokens: int, repeats: int, threads: int,
        adapter: str | None, cache: Path) -> dict[str, Any]:  # fmt: skip
    """Build the four systems, warm them, time them prompt by prompt, interleaved (module docstring)."""
    from molora.adapters.io import read_adapter
    from molora.bench.peer import gguf_file, llama_info
    from molora.bench.peer_gguf import head_counts, lora_to_gguf
    from molora.bench.speculative import prompts as bench_prompts
    from molora.bundle import default_bundle_dir, load, read_bundle
    from molora.config import SamplingParams
    from molora.engine import Engine, EngineConfig
    from molora.engine.speculative import SpeculativeConfig
    from molora.model.base import default_gguf_path
    from molora.model.lora_linear import linear_shapes
    from molora.prompts import stop_ids

    spec = SpeculativeConfig.parse(spec_json)
    if spec.method != "ngram":
        raise SystemExit(f'molora bench peer --speculative: method {spec.method!r}; llama.cpp\'s lookup is "ngram"')
    torch.set_num_threads(threads)
    bundle = read_bundle(default_bundle_dir())
    paths = {a.name: Path(a.path) for a in bundle.adapters}
    name = adapter or next(iter(paths))
    if name not in paths:
        raise SystemExit(f"molora bench peer --adapter {name!r}: the default bundle has {sorted(paths)}")
    mm = load(None)
    groups = bench_prompts(mm, items)
    stops = set(stop_ids(mm))
    src = default_gguf_path()
    gguf = gguf_file(llama, src, "F32", cache, threads)
    n_head, n_kv, n_layers = head_counts(src)
    longest = max(len(p) for g in groups.values() for p in g) + new_tokens + 8
    cfg = dict(max_num_seqs=1, block_size=16, kv_budget_tokens=longest + 16, max_model_len=longest)
    cfg["enable_prefix_caching"] = False  # every prompt computed afresh, as llama.cpp does here
    engines = {
        "molora": Engine(mm, EngineConfig(**cfg)),
        "molora_spec": Engine(mm, EngineConfig(**cfg, speculative=spec)),
    }
    params = SamplingParams(max_new_tokens=new_tokens, stop_token_ids=tuple(sorted(stops)))
    with tempfile.TemporaryDirectory() as tmp:  # llama.cpp reads the LoRA file when the context is made
        lora = lora_to_gguf(
            read_adapter(paths[name], linear_shapes(mm.model)), Path(tmp) / f"{name}.gguf", n_head, n_kv, n_layers
        )
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(
            max_ngram_size=spec.prompt_lookup_max, num_pred_tokens=spec.num_speculative_tokens
        )
        peers = {
            "llama.cpp": LlamaCppGreedy(llama, gguf, lora, longest + 16, threads),
            "llama.cpp_spec": LlamaCppGreedy(llama, gguf, lora, longest + 16, threads, draft),
        }

    def one(system: str, p: list[int]) -> list[int]:
        if system in engines:
            return engines[system].generate([p], params, adapter=name)[0].new_token_ids
        return peers[system].generate(p, new_tokens, stops)

    for s in SYSTEMS:  # warm-up: kernels, packed weights, llama.cpp's graph
        one(s, groups["skills"][0])
    record: dict[str, Any] = {
        "bench": "peer_speculative",
        "machine_info": machine_info(),
        "llama_cpp": {**llama_info(llama), "n_threads": threads, "api": "llama_cpp.Llama.generate (high-level)"},
        "llama_cpp_draft": f"llama_cpp.llama_speculative.LlamaPromptLookupDecoding(max_ngram_size="
        f"{spec.prompt_lookup_max}, num_pred_tokens={spec.num_speculative_tokens})",
        "speculative": spec_json,
        "adapter": name,
        "gguf": gguf.name,
        "items_per_skill": items,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "threads": threads,
        "groups": {},
    }
    for gname, group in groups.items():
        rounds: list[dict[str, float]] = []  # seconds per system per round
        outs: dict[str, list[list[int]]] = {s: [] for s in SYSTEMS}
        before = engines["molora_spec"].stats()["speculative"]
        for r in range(repeats):
            secs = dict.fromkeys(SYSTEMS, 0.0)
            toks = dict.fromkeys(SYSTEMS, 0)
            for i, p in enumerate(group):
                for s in rotated(list(SYSTEMS), r * len(group) + i):
                    t0 = time.perf_counter()
                    o = one(s, p)
                    secs[s] += time.perf_counter() - t0
                    toks[s] += len(o)
                    if r == 0:
                        outs[s].append(o)
            rounds.append({s: toks[s] / secs[s] for s in SYSTEMS})
            stderr_log(f"  {gname} round {r}: " + ", ".join(f"{s} {x:.2f} tok/s" for s, x in rounds[-1].items()))
        after = engines["molora_spec"].stats()["speculative"]
        chunks = after["verified_chunks"] - before["verified_chunks"]
        emitted = (after["mean_acceptance_length"] or 0) * after["verified_chunks"] - (
            before["mean_acceptance_length"] or 0
        ) * before["verified_chunks"]
        med = statistics.median
        record["groups"][gname] = {
            "requests": len(group),
            "output_tokens": {s: sum(len(o) for o in outs[s]) for s in SYSTEMS},
            "tok_s_rounds": [{s: round(x, 3) for s, x in rd.items()} for rd in rounds],
            "median_tok_s": {s: round(med(rd[s] for rd in rounds), 2) for s in SYSTEMS},
            # tok/s ratios per round (> 1: the first is faster), their median
            "median_ratio_over_molora": {s: round(med(rd[s] / rd["molora"] for rd in rounds), 4) for s in SYSTEMS},
            "median_ratio_llama_spec_over_molora_spec": round(
                med(rd["llama.cpp_spec"] / rd["molora_spec"] for rd in rounds), 4
            ),
            "median_ratio_llama_spec_over_llama": round(
                med(rd["llama.cpp_spec"] / rd["llama.cpp"] for rd in rounds), 4
            ),
            "molora_ids_per_verified_chunk": round(emitted / chunks, 4) if chunks else None,
            "molora_carry_cut_rows": after["carry_cut_rows"] - before["carry_cut_rows"],
            "greedy_agreement_with_molora": {s: _agreement(outs["molora"], outs[s]) for s in SYSTEMS},
        }
        stderr_log(f"  {gname}: {record['groups'][gname]['median_tok_s']}")
    record["machine_info"]["loadavg_after"] = machine_info()["loadavg_1_5_15"]
    return record


def main(argv: list[str], spec_json: str) -> int:
    """`molora bench peer --speculative JSON ...` (module docstring): argv without --speculative and its value."""
    import argparse

    from molora.bench.common import emit
    from molora.bench.peer import ready_llama_cpp
    from molora.model.base import cache_root

    ap = argparse.ArgumentParser(prog="molora bench peer --speculative", description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=2, help="prompts per skill, and 4x as many chat prompts (default 2)")
    ap.add_argument("--new-tokens", type=int, default=64, help="greedy new tokens at most (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds over every prompt (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch and llama.cpp threads (default 1, as the peer bench)")
    ap.add_argument("--adapter", help="the default bundle's adapter every prompt runs on (default: its first)")
    ap.add_argument("--cache", type=Path, help="where the GGUF files are made (default $MOLORA_CACHE/peer)")
    ap.add_argument("--json", metavar="OUT", help="also write the record to this file")
    args = ap.parse_args(argv)
    llama = ready_llama_cpp("peer_speculative")
    if llama is None:
        return 0
    cache = args.cache or cache_root() / "peer"
    a = args
    rec = run(llama, spec_json, a.items, a.new_tokens, a.repeats, a.threads, a.adapter, cache)
    import shlex

    cmd = ["molora", "bench", "peer", "--speculative", spec_json, *argv]
    emit({"command": " ".join(shlex.quote(x) for x in cmd), **rec}, args.json)
    return 0
