"""What the sampling knobs cost at batch 32: decode tokens/s with penalties on against off, on the real model.

    .venv/bin/python -m experiments.sampling_knobs_cost --json docs/sampling_knobs_cost.json [--steps 30] [--threads 1]
    .venv/bin/python -m experiments.sampling_knobs_cost --render-only    # docs/serving.md's block from the record

Writes docs/sampling_knobs_cost.json. SmolLM2-135M (molora.model.base.load_base, vocabulary 49152), one random
adapter left unused (routing "none": the cheapest step, where the sampler's share is largest), 32 requests of
16-token random prompts, greedy, eos ignored. One engine per variant, each with its 32 requests prefilled and
decoding; their decode steps run interleaved, the order rotated every repetition, and each variant's tokens/s is
32 / its median step time:

  off         SamplingParams defaults: no row adjusts its logits (the sampler's old path)
  penalties   presence_penalty 0.5, frequency_penalty 0.5, repetition_penalty 1.1 on every row
  all_knobs   the penalties plus 16 logit_bias entries and 8 two-token bad words on every row

Then the sampler alone (molora.engine.sampler.sample_step on logits [32, 49152], no model), off against each
variant, with 64 and 512 generated ids per row: the penalties' counts grow with the output. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from molora import attach
from molora.bench.common import emit, machine_info, rotated, stderr_log, timed_ms
from molora.bench.engine import bench_config, make_adapters
from molora.config import SamplingParams
from molora.docblock import markers, replace_block, wrap
from molora.engine import Engine
from molora.engine.request import Request
from molora.engine.sampler import sample_step

BATCH = 32
PROMPT = 16
ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs" / "sampling_knobs_cost.json"
PAGE = ROOT / "docs" / "serving.md"
BEGIN, END = markers("knobcost", "experiments/sampling_knobs_cost.py")


def render(rec: dict) -> str:
    cost, tok_s, m = rec["decode_cost_vs_off"], rec["decode_tok_s"], rec["machine"]
    line = (
        f"**Cost of the sampling knobs.** Decode at batch {rec['batch']} ({rec['model']}; {m['cpu']}, {m['threads']} "
        f"torch thread): {tok_s['off']:.0f} tokens/s with no knob; presence, frequency and repetition penalties on "
        f"every row {cost['penalties'] * 100:.1f}% fewer, with 16 logit_bias entries and 8 bad words as well "
        f"{cost['all_knobs'] * 100:.1f}% fewer (goal: at most 5%). Medians of interleaved steps; record "
        f"[sampling_knobs_cost.json](sampling_knobs_cost.json), `{rec['command']}`."
    )
    return wrap(BEGIN, END, line)


def variants(max_new_tokens: int, vocab: int) -> dict[str, SamplingParams]:
    rng = random.Random(0)
    penalties = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)
    bias = {rng.randrange(vocab): rng.choice([-5.0, 5.0]) for _ in range(16)}
    words = tuple((rng.randrange(vocab), rng.randrange(vocab)) for _ in range(8))
    base = dict(max_new_tokens=max_new_tokens, ignore_eos=True)
    return {
        "off": SamplingParams(**base),
        "penalties": SamplingParams(**base, **penalties),
        "all_knobs": SamplingParams(**base, **penalties, logit_bias=bias, bad_words_ids=words),
    }


def decode_steps(mm: Any, steps: int, warm: int) -> dict[str, list[float]]:
    """ms of each timed decode step per variant (32 sequences decoding), steps interleaved and rotated."""
    vocab = mm.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (PROMPT,), generator=g).tolist() for _ in range(BATCH)]
    new = warm + steps + 8
    cfg = bench_config(BATCH, PROMPT + new + 16)
    engines = {}
    for name, params in variants(new, vocab).items():
        eng = Engine(mm, cfg)
        for p in prompts:
            eng.add_request(p, params, routing="none")
        for _ in range(warm):  # the prefill, then a few decode steps: every row has generated ids to count
            eng.step()
        assert all(r.num_generated >= 1 for r in eng.requests.values()), "prefill unfinished"
        engines[name] = eng
    times: dict[str, list[float]] = {n: [] for n in engines}
    for i in range(steps):
        for name in rotated(list(engines), i):
            times[name].append(timed_ms(engines[name].step))
        stderr_log(f"  step {i}: " + ", ".join(f"{n} {t[-1]:.1f} ms" for n, t in times.items()))
    return times


def sampler_alone(vocab: int, generated: int, repeats: int) -> dict[str, float]:
    """Median ms of sample_step over 32 rows of random logits [32, V] whose requests generated `generated` ids."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(BATCH, vocab, generator=g)
    ids = torch.randint(0, vocab, (BATCH, PROMPT + generated), generator=g).tolist()
    reqs = {}
    for name, params in variants(generated + 8, vocab).items():
        rows = []
        for j in range(BATCH):
            req = Request(f"{name}{j}", ids[j][:PROMPT], params, route=None)
            req.tokens = list(ids[j])
            rows.append(req)
        reqs[name] = rows
    times: dict[str, list[float]] = {n: [] for n in reqs}
    for i in range(repeats):
        for name in rotated(list(reqs), i):
            times[name].append(timed_ms(lambda: sample_step(reqs[name], logits, [True] * BATCH, frozenset())))
    return {n: statistics.median(t) for n, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps per variant (default 30)")
    ap.add_argument("--warm", type=int, default=4, help="steps before timing: the prefill and a few decodes")
    ap.add_argument("--sampler-repeats", type=int, default=30, help="sample_step calls per variant (default 30)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--json", metavar="OUT", help="write the record here (docs/sampling_knobs_cost.json)")
    ap.add_argument("--render-only", action="store_true", help="render docs/serving.md's block from the record")
    args = ap.parse_args(argv)
    if args.render_only:
        text = PAGE.read_text()
        PAGE.write_text(
            replace_block(text, BEGIN, END, render(json.loads(Path(args.json or RECORD).read_text())), PAGE)
        )
        return 0
    torch.set_num_threads(args.threads)
    from molora.model.base import load_base

    model, _tok = load_base()
    vocab = model.config.vocab_size
    with tempfile.TemporaryDirectory() as tmp:
        mm = attach(model, make_adapters(model, Path(tmp), 1, 8))
        with torch.no_grad():
            times = decode_steps(mm, args.steps, args.warm)
    med = {n: statistics.median(t) for n, t in times.items()}
    tok_s = {n: BATCH * 1e3 / m for n, m in med.items()}
    alone = {f"generated_{n}": sampler_alone(vocab, n, args.sampler_repeats) for n in (64, 512)}
    result = {
        "record": "sampling_knobs_cost",
        "command": "python -m experiments.sampling_knobs_cost --json docs/sampling_knobs_cost.json "
        f"--steps {args.steps} --warm {args.warm} --sampler-repeats {args.sampler_repeats} --threads {args.threads}",
        "model": "SmolLM2-135M-Instruct (fp32), routing none",
        "batch": BATCH,
        "prompt_len": PROMPT,
        "vocab": vocab,
        "variants": {
            "off": "SamplingParams defaults",
            "penalties": "presence_penalty 0.5, frequency_penalty 0.5, repetition_penalty 1.1",
            "all_knobs": "the penalties + 16 logit_bias entries (+-5) + 8 two-token bad_words_ids",
        },
        "decode_step_ms_median": med,
        "decode_tok_s": tok_s,
        # the cost: 1 - tok/s(variant) / tok/s(off), from the medians
        "decode_cost_vs_off": {n: 1 - tok_s[n] / tok_s["off"] for n in tok_s if n != "off"},
        "decode_step_ms_samples": {n: [round(x, 3) for x in t] for n, t in times.items()},
        "sampler_alone_ms_median": alone,
        "machine": machine_info(),
    }
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
