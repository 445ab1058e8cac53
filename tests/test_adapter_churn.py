"""Fuzz: loads, unloads (draining and forced) and reloads of the same names with other weights, interleaved with
requests and steps, under slot and CPU-tier pressure; no request is ever served by the wrong adapter (its tokens
equal those of the weights its name had when it was queued, computed alone), none is lost, and the pins, KV pool
and tier bounds add up after every operation. Driven through the engine API with seeded, exact interleavings."""

from __future__ import annotations

import random

import pytest
import torch

import molora
from molora.config import SamplingParams
from molora.engine import Engine, EngineConfig
from molora.engine.loader import folder_bytes
from molora.errors import AdapterDraining, AdapterError
from tests.conftest import VOCAB, make_peft_adapter, tiny_model

ARCH = "qwen3"
NAMES = ["n0", "n1", "n2", "n3"]
VARIANTS = 2  # weights each name may be (re)loaded with
PROMPTS = 4
CFG = dict(
    max_num_seqs=6, max_tokens_per_step=32, block_size=4, kv_budget_tokens=512, max_model_len=64, stop_at_eos=False
)
GREEDY = SamplingParams(max_new_tokens=4)


def _prompt(p: int) -> list[int]:
    return torch.randint(3, VOCAB, (5 + p,), generator=torch.Generator().manual_seed(100 + p)).tolist()


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    """(name, v) -> folder; every folder has its own weights (seeded)."""
    root = tmp_path_factory.mktemp("churn")
    return {
        (n, v): make_peft_adapter(
            root / f"{n}_v{v}", ARCH, r=4, targets=("q_proj", "v_proj", "up_proj"), seed=200 + 10 * i + v
        )
        for i, n in enumerate(NAMES)
        for v in range(VARIANTS)
    }


@pytest.fixture(scope="module")
def reference(variants):
    """(folder, prompt) -> greedy tokens of that folder's weights alone; the variants must be tell-apart-able."""
    out = {}
    for path in variants.values():
        engine = Engine(molora.attach(tiny_model(ARCH), {"solo": path}), EngineConfig(**CFG))
        for p, o in enumerate(engine.generate([_prompt(p) for p in range(PROMPTS)], GREEDY, adapter="solo")):
            out[path, p] = o.new_token_ids
    for p in range(PROMPTS):
        assert len({tuple(out[path, p]) for path in variants.values()}) >= len(variants) - 1
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_engine_churn_never_serves_the_wrong_adapter(variants, reference, seed):
    rng = random.Random(seed)
    one = folder_bytes(variants["n0", 0])
    mm = molora.attach(tiny_model(ARCH), {"n0": variants["n0", 0]}, slots=2)
    engine = Engine(mm, EngineConfig(**CFG, cpu_tier_bytes=int(1.5 * one)))
    hs = engine.hotset
    current = {"n0": variants["n0", 0]}  # name -> folder it was last loaded from
    expect: dict[str, tuple] = {}  # request id -> (folder, prompt)
    forced: set[str] = set()  # request ids a forced unload may abort
    got: dict[str, list[int]] = {}
    ends: dict[str, str] = {}

    def record(outs):
        for o in outs:
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                ends[o.request_id] = o.finish_reason

    for _ in range(250):
        op = rng.random()
        live = [n for n in hs.paths if n not in hs.draining]
        if op < 0.4 and live:
            name, p = rng.choice(live), rng.randrange(PROMPTS)
            expect[engine.add_request(_prompt(p), GREEDY, adapter=name)] = (current[name], p)
        elif op < 0.55 and hs.paths:
            name, force = rng.choice(list(hs.paths)), rng.random() < 0.3
            if force:
                forced.update(r.request_id for r in engine.scheduler.users(name))
            engine.unload_adapter(name, force=force)
        elif op < 0.7:
            name, path = rng.choice(NAMES), variants[rng.choice(NAMES), rng.randrange(VARIANTS)]
            before = (list(hs.paths), dict(hs.pins), hs.cpu_used)
            try:
                if rng.random() < 0.5:
                    engine.load_adapter(name, str(path))
                else:
                    engine.load_adapter(name, engine.read_adapter(name, str(path)))
                current[name] = path
            except (AdapterDraining, AdapterError) as e:  # in use or draining: refused, nothing changed
                assert name in hs.paths, e
                assert (list(hs.paths), dict(hs.pins), hs.cpu_used) == before
        else:
            record(engine.step())
        engine.scheduler.check()  # pins, KV blocks, tier bounds (HotSet.check)
    while engine.has_unfinished():
        record(engine.step())
        engine.scheduler.check()
    assert set(ends) == set(expect), "a request was lost"
    wrong = {
        rid: (got.get(rid), reference[k])
        for rid, k in expect.items()
        if ends[rid] == "length" and got.get(rid) != reference[k]
    }
    assert not wrong, f"served by the wrong adapter: {wrong}"
    assert all(ends[rid] == "length" or (ends[rid] == "abort" and rid in forced) for rid in expect), ends
    assert sum(e == "length" for e in ends.values()) > len(expect) // 2
    assert not hs.pins and engine.allocator.num_free == engine.allocator.num_blocks
