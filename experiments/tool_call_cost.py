"""What tool calling costs at batch 32: decode tokens/s with tools against the same requests without, real model.

    .venv/bin/python -m experiments.tool_call_cost --json docs/tool_call_cost.json --steps 60 --warm 3 --threads 1
    .venv/bin/python -m experiments.tool_call_cost --render-only     # docs/serving.md's block from the record

Writes docs/tool_call_cost.json. The embedded default bundle (`molora.load()`: SmolLM2-135M-Instruct, fp32, its
four adapters and its learned router: every token routed, as the server runs `model=molora-default`), 32 chat
requests decoding together, greedy. The prompts are what the server builds: each request is a
`ChatCompletionRequest` of one user message (32 different ones, the same in every variant) turned into ids by the
server's own chat encoding (molora.server.generation._encode_chat), and a required choice's constraint is the
server's (molora.server.tools.structured_spec, compiled by molora.structured.StructuredCompiler for the bundle's
tokenizer). One engine per variant, each with its 32 requests prefilled and decoding; their decode steps run
interleaved, the order rotated every repetition; a variant's tokens/s is 32 / its median step time:

  plain           the user messages alone (the bundle's prompt template, as the server renders a lone user message)
  tools_auto      the same messages with 3 function tools (send_email, create_note, schedule_meeting) rendered
                  into the prompt (molora's default rendering: SmolLM2's template does not take `tools`), no
                  constraint: tool_choice "auto", whose calls are parsed after the answer ends (`hermes`)
  tools_required  the same prompts as tools_auto and tool_choice "required" (parallel_tool_calls true, the
                  default): the grammar constraint (a JSON array of calls of any of the 3 functions) on every row

plain and tools_auto ignore eos (nothing constrains them, so a row never ends and the batch stays 32). A grammar
row cannot ignore eos: once its call is complete the grammar allows only the end, and the row would dead-end.
So tools_required (1) gives every function a long free-text string argument (an email body, a note's text, a
meeting agenda) and the messages ask for long texts, so most calls are still writing that string after the timed
steps, and (2) restarts a row that finished anyway: before each of its timed steps, a finished row is replaced by
the same request anew and the engine steps, untimed, until every row decodes again (prefix caching makes the
refill cheap). Only steps where all 32 rows decode are timed, in every variant; the record counts the restarts.
Restarting keeps the batch full and every timed step a constrained one, where option (1) alone would leave a
batch that shrinks by chance; a restarted row re-writes the start of a call (name and argument keys), which is
part of the work a constraint does.

The cost is reported as ratios of the median step times' tokens/s: tools_auto / plain (longer prompts: more KV
to attend to), tools_required / tools_auto (the grammar alone: mask fill on the engine's worker thread,
overlapping the forward, and applying the mask) and tools_required / plain (all of it). Separately, per answer:
the `hermes` parser's time on each tools_auto answer (its ids up to the first stop id, decoded; the answers are
only as long as the steps run; a model that writes no call takes the parser's cheapest path), the same parser
on one answer that holds a ~2 KB call, and, for each tools_required answer that finished, the `json` parser's
time and the answer check's (GrammarConstraint.check). `paired_ratios` gives the same ratios step by step
(median and quartiles). Ends with one JSON line. --render-only rewrites the block between
`<!-- toolcost:begin (experiments/tool_call_cost.py) -->` and `<!-- toolcost:end -->` in docs/serving.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from molora.bench.common import emit, machine_info, paired_ratio, rotated, stderr_log, timed_ms
from molora.config import SamplingParams
from molora.docblock import markers, replace_block, wrap

BATCH = 32
ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs" / "tool_call_cost.json"
PAGE = ROOT / "docs" / "serving.md"
BEGIN, END = markers("toolcost", "experiments/tool_call_cost.py")
VARIANTS = ("plain", "tools_auto", "tools_required")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "send_email",
            "description": "Send an email from the user's account.",
            "parameters": {
                "type": "object",
                "properties": {
                    "to": {"type": "string", "description": "the recipient's email address"},
                    "subject": {"type": "string", "description": "the subject line"},
                    "body": {"type": "string", "description": "the full text of the email, several paragraphs"},
                },
                "required": ["to", "subject", "body"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "create_note",
            "description": "Save a note in the user's notebook.",
            "parameters": {
                "type": "object",
                "properties": {
                    "title": {"type": "string"},
                    "text": {"type": "string", "description": "the note's full text"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["title", "text"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "schedule_meeting",
            "description": "Put a meeting in the user's calendar and invite people.",
            "parameters": {
                "type": "object",
                "properties": {
                    "title": {"type": "string"},
                    "start": {"type": "string", "description": "ISO 8601 date and time"},
                    "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480},
                    "attendees": {"type": "array", "items": {"type": "string"}},
                    "agenda": {"type": "string", "description": "a detailed agenda, one paragraph per item"},
                },
                "required": ["title", "start", "duration_minutes", "agenda"],
            },
        },
    },
]

MESSAGES = [
    "Email my landlord at landlord@example.com a long, polite letter about the broken heating in my flat.",
    "Write a detailed note about everything I need to pack for a two-week hiking trip in the Alps.",
    "Schedule a project kickoff meeting tomorrow at 10:00 for an hour with Ana and Raj, with a full agenda.",
    "Send my team (team@example.com) a thorough update on the quarterly sales figures and next steps.",
    "Make a note with a step-by-step recipe for a vegetable lasagna for eight people.",
    "Email professor.lee@example.edu asking for an extension on my thesis, explaining the reasons at length.",
    "Book a 90-minute design review on Friday at 14:00 with the whole UI team and a detailed agenda.",
    "Write a long note summarising the history of the Roman Empire for my exam revision.",
    "Send a warm thank-you email to grandma@example.com describing our holiday in Portugal in detail.",
    "Schedule a parent-teacher meeting next Monday at 16:30 and list every topic I want to raise.",
    "Email support@example.com a complaint about a laptop that arrived damaged, with all the details.",
    "Create a note with a full weekly workout plan for someone training for a half marathon.",
    "Send hr@example.com a long email explaining why I would like to work from home two days a week.",
    "Set up a one-hour budget planning meeting on 3 March at 09:00 with finance, with an item-by-item agenda.",
    "Write a note describing, in detail, how to set up a small home aquarium for beginners.",
    "Email my neighbour at sam@example.com about the garden fence, proposing a plan and sharing the costs.",
    "Schedule a two-hour onboarding session for the new hires next Tuesday at 13:00 with a complete agenda.",
    "Make a long note of my meeting minutes: we discussed the launch date, the budget, hiring and marketing.",
    "Send an email to the board (board@example.org) presenting the annual report's main findings at length.",
    "Write a note with detailed instructions for feeding and walking my dog while I am away for a week.",
    "Email a cover letter for a junior data analyst position to jobs@example.com, a full page long.",
    "Schedule a retrospective for the mobile team on Thursday at 11:00 for 45 minutes, with a full agenda.",
    "Create a detailed note about the differences between renting and buying a house.",
    "Send my book club (books@example.com) a long email reviewing the novel we read this month.",
    "Put a dentist appointment in my calendar for next Wednesday at 08:30 with notes on what to ask.",
    "Email the city council at council@example.gov about the need for a safer crossing near the school.",
    "Write a long note with my travel itinerary for five days in Tokyo, day by day.",
    "Schedule a vendor negotiation call on the 12th at 15:00 for an hour, listing every point to negotiate.",
    "Send an email to alex@example.com apologising for missing the wedding and telling the whole story.",
    "Make a note explaining, step by step, how to change a flat tyre on a bicycle.",
    "Email the editor at editor@example.com a long pitch for a feature article on urban beekeeping.",
    "Schedule a study group for Saturday at 10:00 for three hours with a detailed plan of the chapters.",
]


# ------------------------------------------------------------------------------------------------ requests


def prompts_and_constraint(mm: Any) -> tuple[dict[str, list[list[int]]], Any, Any, dict]:
    """(prompt ids per variant, the required choice's compiled constraint, the server's ModelInfo, facts)."""
    from molora.server.app import model_info
    from molora.server.generation import _encode_chat
    from molora.server.protocol import ChatCompletionRequest
    from molora.server.tools import structured_spec
    from molora.structured import StructuredCompiler

    info = model_info(mm.bundle.name, mm.tokenizer, mm.bundle, config=mm.model.config, max_model_len=2048, adapters=[])

    def req(msg: str, **extra: Any) -> ChatCompletionRequest:
        return ChatCompletionRequest(model=info.name, messages=[{"role": "user", "content": msg}], **extra)

    prompts = {
        "plain": [_encode_chat(info, req(m)) for m in MESSAGES],
        "tools_auto": [_encode_chat(info, req(m, tools=TOOLS, tool_choice="auto")) for m in MESSAGES],
        "tools_required": [_encode_chat(info, req(m, tools=TOOLS, tool_choice="required")) for m in MESSAGES],
    }
    assert prompts["tools_auto"] == prompts["tools_required"], "auto and required render the same prompt"
    spec, _param = structured_spec(req(MESSAGES[0], tools=TOOLS, tool_choice="required"))
    t0 = time.perf_counter()
    compiler = StructuredCompiler(mm.tokenizer, vocab_size=info.vocab_size, stop_token_ids=info.stop_token_ids)
    t1 = time.perf_counter()
    constraint = compiler.compile(spec)
    t2 = time.perf_counter()
    facts = {
        "prompt_tokens_median": {n: statistics.median(len(p) for p in ps) for n, ps in prompts.items()},
        "required_schema_chars": len(spec.text),
        "tokenizer_setup_s": t1 - t0,
        "compile_ms": (t2 - t1) * 1e3,
    }
    return prompts, constraint, info, facts


def prefilling(eng: Any) -> bool:
    return any(r.num_computed < len(r.tokens) - 1 for r in eng.requests.values())


class Variant:
    """One engine with its 32 requests; `ready()` refills finished rows (required only) and prefills, untimed."""

    def __init__(self, mm: Any, cfg: Any, prompts: list[list[int]], params: SamplingParams, constraint: Any) -> None:
        from molora.engine import Engine

        self.eng = Engine(mm, cfg)
        self.prompts, self.params, self.constraint = prompts, params, constraint
        self.rows: dict[str, Any] = {}  # request id -> the engine's Request
        self.finished: list[Any] = []  # the Requests of rows that ended (required only)
        self.restarts = 0
        for i in range(len(prompts)):
            self._add(i)

    def _add(self, i: int) -> None:
        rid = self.eng.add_request(
            self.prompts[i], self.params, request_id=f"r{i}.{self.restarts}", constraint=self.constraint
        )
        self.rows[rid] = self.eng.requests[rid]

    def step(self) -> None:
        for out in self.eng.step():
            if out.finished:
                self.finished.append(self.rows.pop(out.request_id))

    def ready(self) -> int:
        """Restart the rows that ended, then step (untimed) until every row decodes; the untimed steps taken."""
        live = {int(rid[1:].split(".")[0]) for rid in self.rows}
        for i in range(len(self.prompts)):
            if i not in live:
                self.restarts += 1
                self._add(i)
        n = 0
        while prefilling(self.eng) or len(self.eng.requests) < len(self.prompts):
            self.step()
            n += 1
            if n > 200:
                raise RuntimeError("rows keep ending during their refill")
        return n


def decode_steps(mm: Any, prompts: dict, constraint: Any, steps: int, warm: int) -> tuple[dict, dict]:
    from molora.engine import EngineConfig

    longest = max(len(p) for ps in prompts.values() for p in ps)
    new = warm + steps + 16
    cfg = EngineConfig(max_num_seqs=BATCH, max_model_len=2048, kv_budget_tokens=BATCH * (longest + 600))
    free = SamplingParams(max_new_tokens=new, ignore_eos=True)
    variants = {
        "plain": Variant(mm, cfg, prompts["plain"], free, None),
        "tools_auto": Variant(mm, cfg, prompts["tools_auto"], free, None),
        "tools_required": Variant(mm, cfg, prompts["tools_required"], SamplingParams(max_new_tokens=512), constraint),
    }
    for name, v in variants.items():
        t0 = time.perf_counter()
        n = v.ready()
        for _ in range(warm):
            v.step()
        stderr_log(f"  {name}: prefill {n} steps, {time.perf_counter() - t0:.1f} s")
    times: dict[str, list[float]] = {n: [] for n in variants}
    for i in range(steps):
        for name in rotated(list(variants), i):
            v = variants[name]
            v.ready()
            assert len(v.eng.requests) == BATCH and not prefilling(v.eng)
            times[name].append(timed_ms(v.step))
        stderr_log(f"  step {i}: " + ", ".join(f"{n} {t[-1]:.1f} ms" for n, t in times.items()))
    return times, variants


# ------------------------------------------------------------------------------------------------ parsing


def _median_us(fn: Any, repeats: int = 50) -> float:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts)


def parse_times(variants: dict, info: Any) -> dict:
    from molora.server.tools import HermesParser, JsonParser

    tok, stops = info.tokenizer, set(info.stop_token_ids)

    def answer(ids: list[int]) -> str:
        cut = next((k for k, t in enumerate(ids) if t in stops), len(ids))
        return tok.decode(ids[:cut], skip_special_tokens=True)

    hermes, js = HermesParser(), JsonParser()
    auto = variants["tools_auto"].eng
    texts = [answer(r.tokens[len(r.prompt_ids) :]) for r in auto.requests.values()]
    auto_us = [_median_us(lambda t=t: hermes.parse(t)) for t in texts]
    req_v = variants["tools_required"]
    done = [r for r in req_v.finished if r.finish_reason == "stop"]
    req_texts = [tok.decode(r.tokens[len(r.prompt_ids) :], skip_special_tokens=True) for r in done]
    json_us = [_median_us(lambda t=t: js.parse(t)) for t in req_texts]
    check_us = [_median_us(lambda t=t: req_v.constraint.check(t), 20) for t in req_texts]
    live = [tok.decode(r.tokens[len(r.prompt_ids) :], skip_special_tokens=True) for r in req_v.eng.requests.values()]
    body = " ".join(texts) or "text"  # a call as an auto answer would hold it: the model's own words as its body
    call = {"name": "send_email", "arguments": {"to": "a@example.com", "subject": "Update", "body": body[:2000]}}
    full = "Sure.\n<tool_call>\n" + json.dumps(call) + "\n</tool_call>"
    assert hermes.parse(full)[1], "the synthetic call parses"
    return {
        "hermes_parse_us_one_call": {"chars": len(full), "median": _median_us(lambda: hermes.parse(full))},
        "auto_hermes_parse_us": {
            "answers": len(texts),
            "chars_median": statistics.median(len(t) for t in texts),
            "median": statistics.median(auto_us),
            "max": max(auto_us),
            "answers_with_calls": sum(bool(hermes.parse(t)[1]) for t in texts),
        },
        "required_finished": {
            "answers": len(req_texts),
            "finish_reasons": sorted({str(r.finish_reason) for r in req_v.finished}),
            "json_parse_us_median": statistics.median(json_us) if json_us else None,
            "check_us_median": statistics.median(check_us) if check_us else None,
            "parsed_with_calls": sum(bool(js.parse(t)[1]) for t in req_texts),
        },
        "auto_answer_examples": [t[:200] for t in texts[:3]],
        "required_answer_examples": [t[:200] for t in (req_texts[:2] + live[:2])],
    }


# ------------------------------------------------------------------------------------------------ render


def render(rec: dict) -> str:
    tok_s, r, n = rec["decode_tok_s"], rec["ratios"], rec["prompt_tokens_median"]
    ph = rec["parse"]["auto_hermes_parse_us"]

    def verdict(x: float) -> str:
        return "meets" if x >= 0.95 else "misses"

    line = (
        f"**Cost.** Decode at batch 32 (default bundle, learned routing, greedy; {rec['machine']['cpu']}, "
        f"{rec['machine']['threads']} torch thread): the user messages alone {tok_s['plain']:.0f} tokens/s; the same "
        f"messages with 3 function tools rendered (`auto`, {n['tools_auto']:.0f} prompt tokens against "
        f"{n['plain']:.0f}) {tok_s['tools_auto']:.0f} ({r['tools_auto_over_plain']:.2f}x: the longer prompt, more KV "
        f"to attend to each step); `required`, the grammar on every row, "
        f"{tok_s['tools_required']:.0f} ({r['tools_required_over_tools_auto']:.2f}x `auto`, "
        f"{r['tools_required_over_plain']:.2f}x plain). Against the goal of at most 5% fewer tokens/s, the grammar "
        f"{verdict(r['tools_required_over_tools_auto'])} it and the longer prompt "
        f"{verdict(r['tools_auto_over_plain'])} it. The `hermes` parse of an `auto` answer takes "
        f"{ph['median']:.1f} µs (median; the model wrote no call), one holding a "
        f"{rec['parse']['hermes_parse_us_one_call']['chars']}-character call "
        f"{rec['parse']['hermes_parse_us_one_call']['median']:.0f} µs. "
        f"Medians of {rec['steps']} interleaved steps per variant; record "
        f"[tool_call_cost.json](tool_call_cost.json), `{rec['command']}`."
    )
    return wrap(BEGIN, END, line)


def write_render(rec: dict) -> None:
    text = PAGE.read_text(encoding="utf-8")
    new = replace_block(text, BEGIN, END, render(rec), PAGE)
    if new != text:
        PAGE.write_text(new, encoding="utf-8")


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60, help="timed decode steps per variant (default 60)")
    ap.add_argument("--warm", type=int, default=3, help="decode steps after the prefill, before timing")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--json", metavar="OUT", help="write the record here (docs/tool_call_cost.json)")
    ap.add_argument("--render-only", action="store_true", help="render docs/serving.md's block from the record")
    args = ap.parse_args(argv)
    if args.render_only:
        write_render(json.loads(Path(args.json or RECORD).read_text()))
        return 0
    load_start = [round(x, 2) for x in os.getloadavg()]
    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    import molora

    mm = molora.load()
    prompts, constraint, info, facts = prompts_and_constraint(mm)
    stderr_log(f"prompt tokens (median): {facts['prompt_tokens_median']}, compile {facts['compile_ms']:.0f} ms")
    with torch.no_grad():
        times, variants = decode_steps(mm, prompts, constraint, args.steps, args.warm)
    parse = parse_times(variants, info)
    for v in variants.values():
        v.eng.close()
    med = {n: statistics.median(t) for n, t in times.items()}
    tok_s = {n: BATCH * 1e3 / m for n, m in med.items()}
    result = {
        "record": "tool_call_cost",
        "command": "python -m experiments.tool_call_cost --json docs/tool_call_cost.json "
        f"--steps {args.steps} --warm {args.warm} --threads {args.threads}",
        "model": "SmolLM2-135M-Instruct (fp32), default bundle, learned routing (routing auto: every token routed)",
        "batch": BATCH,
        "steps": args.steps,
        "variants": {
            "plain": "one user message, the bundle's prompt template; eos ignored",
            "tools_auto": "the same message with 3 function tools (molora's default rendering); eos ignored",
            "tools_required": "the same prompt as tools_auto, tool_choice required (parallel_tool_calls): the "
            "grammar constraint on every row; rows that finish are restarted, untimed",
        },
        **facts,
        "decode_step_ms_median": med,
        "decode_step_ms_min": {n: min(t) for n, t in times.items()},
        "decode_tok_s": tok_s,
        # tokens/s ratios of the medians; cost = 1 - ratio
        "ratios": {
            "tools_auto_over_plain": tok_s["tools_auto"] / tok_s["plain"],
            "tools_required_over_tools_auto": tok_s["tools_required"] / tok_s["tools_auto"],
            "tools_required_over_plain": tok_s["tools_required"] / tok_s["plain"],
        },
        # the same ratios step by step (variants timed one right after another in each repetition): median and
        # quartiles of tok/s(a) / tok/s(b) = step(b) / step(a); cancels slow load changes the medians keep
        "paired_ratios": {
            f"{a}_over_{b}": paired_ratio(times[b], times[a])
            for a, b in (("tools_auto", "plain"), ("tools_required", "tools_auto"), ("tools_required", "plain"))
        },
        "goal": "tokens/s cost at most 5% (ratio >= 0.95)",
        "required_restarts": variants["tools_required"].restarts,
        "parse": parse,
        "decode_step_ms_samples": {n: [round(x, 3) for x in t] for n, t in times.items()},
        "load_avg_start": load_start,
        "load_avg_end": [round(x, 2) for x in os.getloadavg()],
        "wall_s": time.perf_counter() - t_start,
        "argv": sys.argv[1:],
        "machine": machine_info(),
    }
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
