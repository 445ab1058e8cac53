"""Chunked prefill under vLLM's names (`max_num_batched_tokens`, `enable_chunked_prefill`): prompts split across
steps give the same greedy tokens (fp32) as prompts run whole; no step computes more tokens than the budget and
decodes always run first; with chunking off no prompt is ever split; a cold request joins the first step after
its adapter's read lands."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import molora
from molora.config import LLAMA_PROJECTIONS, SamplingParams
from molora.engine import Engine, EngineConfig
from molora.errors import MoLoRAError
from molora.routing import VocabRouter
from tests.conftest import VOCAB, make_peft_adapter, tiny_model

ARCH = "qwen3"
BASE: dict[str, Any] = dict(max_num_seqs=6, block_size=4, kv_budget_tokens=1024, max_model_len=64, stop_at_eos=False)
GREEDY = SamplingParams(max_new_tokens=5)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunked")
    specs = {"a": (4, ("q_proj", "v_proj")), "b": (8, ("q_proj", "down_proj")), "c": (2, ("v_proj", "up_proj"))}
    return {n: make_peft_adapter(root / n, ARCH, r=r, targets=t, seed=i) for i, (n, (r, t)) in enumerate(specs.items())}


def _engine(paths, names=("a", "b", "c"), **cfg: Any) -> Engine:
    router = VocabRouter([(0, 50, "a"), (50, 90, "b")], default="c")
    mm = molora.attach(tiny_model(ARCH), {n: paths[n] for n in names}, router=router, target_modules=LLAMA_PROJECTIONS)
    return Engine(mm, EngineConfig(**BASE, **cfg))


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


Chunk = tuple[str, int, int, int]  # (request id, start, n, tokens known)


def _trace(engine: Engine) -> list[tuple[list[Chunk], list[str]]]:
    """Record every step's chunks and the requests that were decoding before it was scheduled."""
    steps: list[tuple[list[Chunk], list[str]]] = []
    schedule = engine.scheduler.schedule

    def traced():
        decoding = [r.request_id for r in engine.scheduler.running if r.remaining == 1]
        out = schedule()
        steps.append(([(s.request.request_id, s.start, s.n, len(s.request.tokens)) for s in out], decoding))
        return out

    engine.scheduler.schedule = traced  # type: ignore[method-assign]
    return steps


def _drive(engine: Engine, requests: list[tuple[list[int], dict]], per_step: int = 2) -> dict[str, list[int]]:
    """Queue `per_step` requests before every step (so prompts arrive together and beside decodes), run to the end."""
    got: dict[str, list[int]] = {}
    pending = list(requests)
    while pending or engine.has_unfinished():
        for prompt, kw in pending[:per_step]:
            got[engine.add_request(prompt, GREEDY, request_id=f"r{len(got)}", **kw)] = []
        del pending[:per_step]
        for out in engine.step():
            assert out.finish_reason in (None, "length"), out.error
            got[out.request_id] += out.new_token_ids
        engine.check()
    return got


REQUESTS = [
    (_prompt(23, 1), dict(adapter="a")),
    (_prompt(17, 2), dict(routing="vocab")),
    (_prompt(30, 3), dict(adapter="b")),
    (_prompt(9, 4), dict(adapter="c")),
    (_prompt(26, 5), dict(routing="none")),
    (_prompt(21, 6), dict(adapter="a")),
]


@torch.no_grad()
def test_chunked_prefill_gives_the_tokens_of_whole_prompts(paths):
    whole = _engine(paths, max_num_batched_tokens=64, enable_chunked_prefill=False)
    chunked = _engine(paths, max_num_batched_tokens=8)
    whole_steps, chunked_steps = _trace(whole), _trace(chunked)
    expect = _drive(whole, REQUESTS)
    assert _drive(chunked, REQUESTS) == expect
    assert all(len(v) == GREEDY.max_new_tokens for v in expect.values())
    # the two runs really differ: chunking split prompts, the other never did
    split = lambda steps: any(n > 1 and start + n < known for chunks, _ in steps for _, start, n, known in chunks)
    assert split(chunked_steps) and not split(whole_steps)


@pytest.mark.parametrize("budget", [7, 12, 40])
def test_no_step_exceeds_the_budget_and_decodes_go_first(paths, budget):
    engine = _engine(paths, max_num_batched_tokens=budget)
    steps = _trace(engine)
    _drive(engine, REQUESTS, per_step=1)
    assert steps and max(sum(n for _, _, n, _ in chunks) for chunks, _ in steps) <= budget
    for chunks, decoding in steps:
        ran = {rid for rid, *_ in chunks}
        # every request that was decoding runs its token (the budget allows them all: 6 seqs < 7)
        assert set(decoding) <= ran
        # a prefill chunk only takes what the decodes left
        assert sum(n for *_, n, _ in chunks) <= budget


def test_chunking_off_waits_for_room_for_the_whole_prompt(paths):
    engine = _engine(paths, max_num_batched_tokens=64, enable_chunked_prefill=False)
    steps = _trace(engine)
    got = _drive(engine, REQUESTS * 2, per_step=3)
    assert len(got) == 12 and all(len(v) == GREEDY.max_new_tokens for v in got.values())
    for chunks, _ in steps:
        assert sum(n for _, _, n, _ in chunks) <= 64
        assert all(start + n == known for _, start, n, known in chunks)  # each reaches its last token: unsplit
    assert engine.prefix is not None and engine.prefix.stats()["hit_tokens"] > 0  # repeated prompts start at a hit


def test_budget_flags_are_checked_and_reach_the_engine():
    from molora.cli import build_parser

    assert EngineConfig().token_budget == 512
    assert EngineConfig(max_tokens_per_step=100).token_budget == 100
    assert EngineConfig(max_tokens_per_step=100, max_num_batched_tokens=48).token_budget == 48
    with pytest.raises(MoLoRAError, match=r"max_num_batched_tokens=0 must be at least 1"):
        EngineConfig(max_num_batched_tokens=0)
    with pytest.raises(MoLoRAError, match=r"enable_chunked_prefill=False a whole prompt must fit one step.*64.*"):
        EngineConfig(max_num_batched_tokens=64, max_model_len=128, enable_chunked_prefill=False)
    EngineConfig(max_num_batched_tokens=128, max_model_len=128, enable_chunked_prefill=False)
    args = build_parser().parse_args(["serve"])
    assert args.max_num_batched_tokens is None and args.enable_chunked_prefill is True
    args = build_parser().parse_args(["serve", "--max-num-batched-tokens", "48", "--no-enable-chunked-prefill"])
    assert args.max_num_batched_tokens == 48 and args.enable_chunked_prefill is False


@torch.no_grad()
def test_a_cold_request_joins_the_first_step_after_its_read_lands(paths):
    engine = _engine(paths, max_num_batched_tokens=16)
    hs = engine.hotset
    hs.unregister("b")  # forgotten in every tier, then registered on disk only: cold
    hs.register_cold("b", paths["b"], None)
    assert hs.tier("b") == "disk"
    warm = [engine.add_request(_prompt(6, i), SamplingParams(max_new_tokens=12), adapter="a") for i in range(3)]
    engine.step()
    engine.step()  # the warm ones are decoding
    cold = engine.add_request(_prompt(9, 7), GREEDY, adapter="b")
    assert "b" in hs.reads  # the read starts when the request is queued, not when it is scheduled
    hs.wait_reads(None)  # the read lands between two steps
    firsts = {o.request_id: o.new_token_ids for o in engine.step()}
    assert firsts[cold] and hs.resident("b")  # admitted, prefilled and sampled in that very step
    assert all(firsts[r] for r in warm)  # beside every warm decode
    alone = _engine(paths).generate([_prompt(9, 7)], GREEDY, adapter="b")[0]
    got = list(firsts[cold])
    while engine.has_unfinished():
        got += [t for o in engine.step() if o.request_id == cold for t in o.new_token_ids]
    assert got == alone.new_token_ids
