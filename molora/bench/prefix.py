"""Prefix-cache benchmark: a shared system prompt and a two-turn chat, cache on against cache off.

    molora bench engine --shared-prefix [--quick] [--json OUT]     (= python -m molora.bench.prefix)

Setup: the embedded default bundle (SmolLM2-135M-Instruct, 4 trained adapters, its learned router: per-block
gates, carry, a probe pass over the prompt, the base expert), fp32 (or --dtype bfloat16), greedy, eos ignored (every
variant does the same work). Two engines over the one model, alike but for `enable_prefix_caching`; the cache-on
engine's cache is emptied before every run, so each run computes the shared prompt once (a cold start, the least the
cache gives: a server that served the prompt before starts warm).

  shared_prefix  N requests arrive at once, each `<system prompt of P tokens><its own question of about Q
                 tokens>` in the bundle's chat template, G new tokens each: output tokens/s of the whole run
                 and the median time to first token (from the arrival of all N)
  chat           C two-turn conversations: turn 1 as above, then turn 2 resends turn 1, its answer and a
                 follow-up question: the share of turn 2's prompt tokens served from the cache, and turn 2's
                 median time to first token
Both under learned routing (the bundle's router: its probe pass is cached too) and pinned (one adapter).
Variants are interleaved within each repetition and their order rotates every repetition (style 18);
medians and paired ratios (per repetition, cache off / cache on) are reported. Ends with one JSON line.
Owns only the workload, timing and reporting; knows the engine through its public API.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from molora.bench.common import (
    emit,
    machine_info,
    paired_ratio,
    rotated,
    rounded,
    set_threads,
)
from molora.config import SamplingParams
from molora.engine import Engine, EngineConfig

SYSTEM_SENTENCES = [
    "You are a careful assistant that answers questions about lists, numbers, brackets and directions.",
    "Read the whole question before you answer, and think about every item it mentions.",
    "When a question asks you to count, count each item of the named category once and give the total.",
    "When a question gives an arithmetic expression, evaluate the innermost parentheses first.",
    "When a question gives a sequence of brackets, close every bracket that is still open, in order.",
    "When a question gives movement instructions, track the position after each step and say whether it "
    "returns to the starting point.",
    "Answer with the result alone, without explanations, unless the user asks for the steps.",
    "If a question is outside these skills, answer it plainly and briefly, as a helpful assistant would.",
]
ITEMS = ["apple", "banana", "violin", "piano", "goat", "rabbit", "carrot", "trumpet", "cabbage", "snail"]


def system_prompt(tokenizer: Any, n_tokens: int) -> list[int]:
    """Ids of `<|im_start|>system\\n...` cut to exactly n_tokens (sentences repeated as needed)."""
    text, i = "<|im_start|>system\n", 0
    while len(tokenizer.encode(text)) < n_tokens + 8:
        text += SYSTEM_SENTENCES[i % len(SYSTEM_SENTENCES)] + " "
        i += 1
    return tokenizer.encode(text)[:n_tokens]


def question(rng: random.Random) -> str:
    """A short question of one of the bundle's skills (about 20-40 tokens)."""
    kind = rng.randrange(4)
    if kind == 0:
        items = ", ".join(f"{rng.choice(['a', 'two', 'three'])} {rng.choice(ITEMS)}" for _ in range(5))
        return f"I have {items}. How many fruits do I have?"
    if kind == 1:
        a, b, c, d = (rng.randint(-9, 9) for _ in range(4))
        return f"(({a} * {b} - {c}) + ({d} - {a} * {c})) ="
    if kind == 2:
        return "Complete the rest of the sequence, making sure the parentheses are closed: " + " ".join(
            rng.choice("([{<") for _ in range(6)
        )
    steps = ", ".join(
        f"take {rng.randint(1, 9)} steps {rng.choice(['forward', 'backward', 'left', 'right'])}" for _ in range(3)
    )
    return f"If you follow these instructions, do you return to the starting point? {steps}."


def turn(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def run_batch(engine: Engine, prompts: list[list[int]], new_tokens: int, kw: dict, cold: bool = True) -> dict:
    """All prompts arrive at once; run to completion. Wall seconds, TTFT per request, outputs, cached tokens.
    cold: empty the cache first (the run computes the shared prompt once)."""
    if cold and engine.prefix is not None:
        engine.prefix.invalidate()
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params, **kw) for p in prompts]
    first: dict[str, float] = {}
    out: dict[str, list[int]] = {i: [] for i in ids}
    cached: dict[str, int] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = time.perf_counter() - t0
            out[o.request_id] += o.new_token_ids
            if o.finished:
                cached[o.request_id] = o.cached_tokens
    wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "ttft_s": [first[i] for i in ids],
        "tokens": [out[i] for i in ids],
        "cached": [cached[i] for i in ids],
    }


def measure(
    engines: dict[str, Engine],
    workloads: dict[str, tuple[list[list[int]], dict]],
    new_tokens: int,
    repeats: int,
    chat_followups: dict[str, list[list[int]]] | None = None,
) -> dict:
    """For each workload (routing), cache on and off interleaved: tok/s, median TTFT, paired ratios."""
    res: dict[str, Any] = {}
    for wname, (prompts, kw) in workloads.items():
        runs: dict[str, list[dict]] = {v: [] for v in engines}
        for v in engines:  # untimed warm-up: kernels loaded, first-call costs paid
            run_batch(engines[v], prompts[:2], 2, kw)
        for i in range(repeats):
            for v in rotated(list(engines), i):
                r = run_batch(engines[v], prompts, new_tokens, kw)
                if chat_followups is not None:  # turn 2: turn 1, its answer, a follow-up (cache kept from turn 1)
                    t2 = [p + t + f for p, t, f in zip(prompts, r["tokens"], chat_followups[wname])]
                    r2 = run_batch(engines[v], t2, new_tokens, kw, cold=False)
                    r = {**r2, "turn2_prompt_tokens": [len(p) for p in t2]}
                runs[v].append(r)
                print(
                    f"  {wname} {v}: {r['wall_s']:.2f} s, median TTFT {statistics.median(r['ttft_s']):.2f} s",
                    file=sys.stderr,
                    flush=True,
                )
        on, off = runs["cache_on"], runs["cache_off"]
        gen = new_tokens * len(prompts)
        same = all(a["tokens"] == b["tokens"] for a, b in zip(on, off))
        w = {
            "tok_s": {v: statistics.median(gen / r["wall_s"] for r in rs) for v, rs in runs.items()},
            "median_ttft_s": {
                v: statistics.median(statistics.median(r["ttft_s"]) for r in rs) for v, rs in runs.items()
            },
            "wall_s_samples": {v: [r["wall_s"] for r in rs] for v, rs in runs.items()},
            "tok_s_ratio_paired": list(paired_ratio([r["wall_s"] for r in off], [r["wall_s"] for r in on])),
            "ttft_ratio_paired": list(
                paired_ratio(
                    [statistics.median(r["ttft_s"]) for r in off], [statistics.median(r["ttft_s"]) for r in on]
                )
            ),
            "outputs_equal": same,
        }
        if chat_followups is not None:
            w["turn2_cached_share"] = statistics.median(sum(r["cached"]) / sum(r["turn2_prompt_tokens"]) for r in on)
            w["turn2_cached_share_min_request"] = min(
                c / n for r in on for c, n in zip(r["cached"], r["turn2_prompt_tokens"])
            )
        w["prefix_cache"] = engines["cache_on"].stats()["prefix_cache"]
        res[wname] = w
    return res


def run(
    requests: int,
    system_len: int,
    new_tokens: int,
    repeats: int,
    chats: int,
    pinned: str,
    dtype: str = "float32",
    routings: Sequence[str] = ("learned", "pinned"),
    json_path: str | None = None,
) -> dict:
    """The whole benchmark; with json_path the record so far is written after every workload (a long run
    stopped early keeps what it measured)."""
    from molora.bundle import load

    mm = load()
    if dtype != "float32":
        mm.to(getattr(torch, dtype))  # weights, adapters and the KV cache (molora.engine.engine)
    tok = mm.tokenizer
    rng = random.Random(0)
    system = system_prompt(tok, system_len)
    questions = [question(rng) for _ in range(requests)]
    prompts = [system + turn(tok, q) for q in questions]
    longest = max(map(len, prompts)) * 2 + 3 * new_tokens + 64
    cfg = dict(
        max_num_seqs=requests,
        max_tokens_per_step=512,
        block_size=16,
        max_model_len=longest,
        kv_budget_tokens=requests * (max(map(len, prompts)) + new_tokens + 32) * 2,
        stop_at_eos=False,
    )
    engines = {
        "cache_on": Engine(mm, EngineConfig(**cfg)),
        "cache_off": Engine(mm, EngineConfig(**cfg, enable_prefix_caching=False)),
    }
    kws = {"learned": {"routing": "auto"}, "pinned": {"adapter": pinned}}
    res: dict[str, Any] = {
        "bench": "prefix_cache",
        "requests": requests,
        "system_tokens": len(system),
        "question_tokens_median": statistics.median(len(p) - len(system) for p in prompts),
        "new_tokens": new_tokens,
        "repeats": repeats,
        "chats": chats,
        "pinned": pinned,
        "dtype": dtype,
        "machine": machine_info(),
    }
    res["shared_prefix"], res["chat"] = {}, {}
    follow = [turn(tok, question(random.Random(100 + i))) for i in range(chats)]
    for part in ("shared_prefix", "chat"):
        for k in routings:
            if part == "shared_prefix":
                res[part].update(measure(engines, {k: (prompts, kws[k])}, new_tokens, repeats))
            else:
                res[part].update(
                    measure(engines, {k: (prompts[:chats], kws[k])}, new_tokens, repeats, chat_followups={k: follow})
                )
            if json_path is not None:
                Path(json_path).write_text(json.dumps(rounded(res), indent=1) + "\n")
    return res


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="molora bench engine --shared-prefix", description=__doc__.split("\n")[0])
    ap.add_argument("--shared-prefix", action="store_true", help="(the flag that selects this benchmark)")
    ap.add_argument("--requests", type=int, default=32, help="requests sharing the system prompt (default 32)")
    ap.add_argument("--system-tokens", type=int, default=512, help="system prompt tokens (default 512)")
    ap.add_argument("--new-tokens", type=int, default=64, help="greedy new tokens per request (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repetitions (default 3; --quick: 1)")
    ap.add_argument("--chats", type=int, default=8, help="two-turn conversations (default 8)")
    ap.add_argument("--pinned", default="arithmetic", help="the adapter of the pinned variant")
    ap.add_argument(
        "--routings",
        nargs="+",
        choices=("learned", "pinned"),
        default=["learned", "pinned"],
        help="which routings to run (default both)",
    )
    ap.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="weights, adapters and KV cache (bfloat16: AMX on this CPU)",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--quick", action="store_true", help="8 requests, 1 repetition, 2 chats")
    ap.add_argument("--json", metavar="OUT", help="also write the result JSON to this file")
    args = ap.parse_args(argv)
    set_threads(args.threads)
    requests, repeats, chats = (8, 1, 2) if args.quick else (args.requests, args.repeats, args.chats)
    with torch.no_grad():
        res = run(
            requests,
            args.system_tokens,
            args.new_tokens,
            repeats,
            chats,
            args.pinned,
            args.dtype,
            args.routings,
            args.json,
        )
    for part in ("shared_prefix", "chat"):
        for routing, w in res[part].items():
            print(
                f"{part} {routing}: tok/s on {w['tok_s']['cache_on']:.1f} off {w['tok_s']['cache_off']:.1f} "
                f"(x{w['tok_s_ratio_paired'][0]:.2f}), median TTFT on {w['median_ttft_s']['cache_on']:.2f} s "
                f"off {w['median_ttft_s']['cache_off']:.2f} s (x{w['ttft_ratio_paired'][0]:.2f} lower)"
                + (f", turn 2 cached {100 * w['turn2_cached_share']:.0f}%" if "turn2_cached_share" in w else "")
                + ("" if w["outputs_equal"] else " OUTPUTS DIFFER")
            )
    emit(rounded(res), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
