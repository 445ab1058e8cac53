"""Pick the grammar engine for structured output by measurement: xgrammar, llguidance, outlines-core.

    python -m experiments.choose_grammar_engine [--out docs/grammar_engines.json] [--steps 48]

On the *validation* split of molora/data/schemas/schemas.json only (the test split is scored once, by
experiments/structured_bench.py, with the engine chosen here), with the real SmolLM2 tokenizer
(`molora.model.base.load_base()`, offline):

  setup_s       building the engine's tokenizer view from the transformers tokenizer (once per process)
  coverage      share of schemas the engine compiles (no error, no timeout)
  compile_ms    median time to compile one schema, cache off (for outlines-core: regex + token index)
  mask_ms_b32   median time of one decode step's masks for 32 requests (32 different schemas, one matcher
                each, each fed its own seeded random walk through the grammar), single thread
  walks_valid   of the random walks that reach the grammar's end, how many parse and validate (jsonschema)

Every engine runs its JSON in compact form (no free whitespace), as molora serves it. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import torch

from molora.bench.common import cpu_model

SCHEMAS = Path(__file__).resolve().parents[1] / "molora" / "data" / "schemas" / "schemas.json"


def load_schemas(split: str) -> list[dict]:
    return [s for s in json.loads(SCHEMAS.read_text())["schemas"] if s["split"] == split]


# ----------------------------------------------------------------------------- one adapter per engine
class Xgr:
    name = "xgrammar"

    def __init__(self, tok: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        t = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size)
        self.setup_s = time.perf_counter() - t
        self.version = getattr(xgr, "__version__", None) or _dist_version("xgrammar")

    def compile(self, schema: dict) -> Any:
        comp = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        return comp.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def accept(self, m: Any, token: int) -> bool:
        return m.accept_token(token)

    def done(self, m: Any) -> bool:
        return m.is_terminated()


class Llg:
    name = "llguidance"

    def __init__(self, tok: Any, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        t = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab_size)
        self.setup_s = time.perf_counter() - t
        self.version = _dist_version("llguidance")

    def compile(self, schema: dict) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False}
        )
        m = self.llg.LLMatcher(self.tok, grammar)
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.llg.LLMatcher(self.tok, compiled)

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        self.llg.torch.fill_next_token_bitmask(m, bitmask, row)

    def accept(self, m: Any, token: int) -> bool:
        return m.consume_token(token) and not m.is_error()

    def done(self, m: Any) -> bool:
        return m.is_stopped()


class Olc:
    """outlines-core takes no transformers tokenizer: the vocabulary is rebuilt here as bytes per token
    (byte-level BPE symbols mapped back to bytes, as the outlines library does)."""

    name = "outlines-core"

    def __init__(self, tok: Any, vocab_size: int) -> None:
        import outlines_core
        from outlines_core.kernels.torch import fill_next_token_bitmask

        self.oc, self._fill = outlines_core, fill_next_token_bitmask
        t = time.perf_counter()
        byte_of = {c: b for b, c in _bytes_to_unicode().items()}
        eos = tok.eos_token_id
        table: dict[bytes, list[int]] = {}
        for text, i in tok.get_vocab().items():
            if i == eos or i in tok.all_special_ids:
                continue
            table.setdefault(
                bytes(byte_of[c] for c in text) if all(c in byte_of for c in text) else text.encode(), []
            ).append(i)
        self.vocab = outlines_core.Vocabulary(eos, table)
        self.setup_s = time.perf_counter() - t
        self.version = _dist_version("outlines_core")

    def compile(self, schema: dict) -> Any:
        from outlines_core.json_schema import build_regex_from_schema

        return self.oc.Index(build_regex_from_schema(json.dumps(schema), None), self.vocab)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        self._fill(m, bitmask[row : row + 1])

    def accept(self, m: Any, token: int) -> bool:
        try:
            m.advance(token)
            return True
        except Exception:
            return False

    def done(self, m: Any) -> bool:
        return m.is_finished()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE vocabularies spell tokens with it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


# ----------------------------------------------------------------------------- measurements
def allowed_ids(bitmask_row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Token ids whose bit is set in one packed int32 row [W]."""
    bits = (bitmask_row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [W, 32]
    return bits.reshape(-1)[:vocab_size].nonzero().squeeze(-1)


def walk(engine: Any, compiled: Any, vocab_size: int, eos: int, steps: int, seed: int) -> tuple[list[int], bool]:
    """A seeded random walk through the grammar: each step a uniformly drawn allowed token. (tokens, ended)."""
    from xgrammar import allocate_token_bitmask

    g = torch.Generator().manual_seed(seed)
    m, mask, out = engine.matcher(compiled), allocate_token_bitmask(1, vocab_size), []
    for _ in range(steps):
        mask.fill_(0)
        engine.fill(m, mask, 0)
        ids = allowed_ids(mask[0], vocab_size)
        if len(ids) == 0:
            return out, False
        # prefer ending: once eos is allowed, take it (a random walk rarely closes every bracket otherwise)
        t = eos if (ids == eos).any() else int(ids[torch.randint(len(ids), (1,), generator=g)])
        if t == eos:
            return out, True
        if not engine.accept(m, t):
            return out, False
        out.append(t)
        if engine.done(m):
            return out, True
    return out, False


def mask_step_ms(engine: Any, compiled: list[Any], walks: list[list[int]], vocab_size: int, batch: int) -> float:
    """Median ms of one step's masks for `batch` matchers (schemas cycled), replaying each row's own walk."""
    from xgrammar import allocate_token_bitmask

    rows = [(compiled[r % len(compiled)], walks[r % len(walks)]) for r in range(batch)]
    matchers = [engine.matcher(c) for c, _ in rows]
    mask = allocate_token_bitmask(batch, vocab_size)
    times = []
    for t in range(max(len(w) for _, w in rows)):
        live = [r for r in range(batch) if t < len(rows[r][1])]
        if len(live) < batch // 2:
            break
        t0 = time.perf_counter()
        for r in live:
            engine.fill(matchers[r], mask, r)
        times.append((time.perf_counter() - t0) * 1e3 * batch / len(live))
        for r in live:
            engine.accept(matchers[r], rows[r][1][t])
    return statistics.median(times)


def measure(engine: Any, schemas: list[dict], tok: Any, vocab_size: int, steps: int, compile_timeout_s: float) -> dict:
    res: dict[str, Any] = {
        "engine": engine.name,
        "version": engine.version,
        "setup_s": round(engine.setup_s, 3),
        "failures": {},
    }
    compiled, ctimes, walks, complete, valid = [], [], [], 0, 0
    for i, s in enumerate(schemas):
        t0 = time.perf_counter()
        try:
            c = engine.compile(s["schema"])
        except Exception as e:  # the engine refuses the schema: that is what coverage counts
            res["failures"][s["name"]] = f"{type(e).__name__}: {str(e)[:200]}"
            continue
        dt = time.perf_counter() - t0
        if dt > compile_timeout_s:
            res["failures"][s["name"]] = f"compiled in {dt:.1f} s, over the {compile_timeout_s} s limit"
            continue
        ctimes.append(dt * 1e3)
        compiled.append(c)
        toks, ended = walk(engine, c, vocab_size, tok.eos_token_id, steps, seed=i)
        walks.append(toks or [tok.eos_token_id])
        if ended:
            complete += 1
            try:
                jsonschema.validators.validator_for(s["schema"])(s["schema"]).validate(json.loads(tok.decode(toks)))
                valid += 1
            except (json.JSONDecodeError, jsonschema.ValidationError) as e:
                res["failures"][s["name"] + " (walk)"] = f"{type(e).__name__}: {str(e)[:200]}"
    res["coverage"] = round(len(compiled) / len(schemas), 3)
    res["compile_ms_median"] = round(statistics.median(ctimes), 2) if ctimes else None
    res["compile_ms_max"] = round(max(ctimes), 2) if ctimes else None
    res["walks_complete"] = complete  # walks that reached the grammar's end within --steps tokens
    res["walks_valid"] = valid  # of those, answers that parse and validate
    res["mask_ms_b32"] = round(mask_step_ms(engine, compiled, walks, vocab_size, 32), 3) if compiled else None
    res["mask_ms_b1"] = round(mask_step_ms(engine, compiled, walks, vocab_size, 1), 3) if compiled else None
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/grammar_engines.json")
    ap.add_argument("--steps", type=int, default=48, help="tokens per random walk")
    ap.add_argument("--compile-timeout-s", type=float, default=20.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from molora.model.base import load_base

    model, tok = load_base()
    vocab_size = int(model.config.vocab_size)
    del model
    schemas = load_schemas("validation")
    results = []
    engines: list[Callable[..., Any]] = [Xgr, Llg, Olc]
    for make in engines:
        try:
            eng = make(tok, vocab_size)
        except Exception as e:
            results.append({"engine": make.name, "error": f"{type(e).__name__}: {e}"})
            continue
        results.append(measure(eng, schemas, tok, vocab_size, args.steps, args.compile_timeout_s))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "failures"}), flush=True)
    record = {
        "split": "validation",
        "schemas": len(schemas),
        "tokenizer": "SmolLM2-135M-Instruct",
        "vocab_size": vocab_size,
        "cpu": cpu_model(),
        "threads": 1,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "results": results,
    }
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(
        json.dumps(
            {r["engine"]: {k: r.get(k) for k in ("coverage", "compile_ms_median", "mask_ms_b32")} for r in results}
        )
    )


if __name__ == "__main__":
    main()
