"""Prefix caching that knows per-token routing: outputs with the cache equal outputs without it, token for
token, in every routing mode, across preemption, adapter reloads and a seeded fuzz run; hits are counted;
the pool's reference counts stay consistent (Engine.check after every step)."""

from __future__ import annotations

import random

import pytest
import torch

import molora
from molora.config import LLAMA_PROJECTIONS, SamplingParams
from molora.engine import Engine, EngineConfig
from molora.engine.kv import BlockAllocator
from molora.routing import ArrowConfig, ArrowRouter, VocabRouter
from molora.routing.learned import LearnedRouter, LearnedRouterConfig, decoder_layers
from tests.conftest import VOCAB, make_peft_adapter, tiny_model

SPECS = {
    "a": dict(r=4, alpha=8, targets=("q_proj", "v_proj", "down_proj")),
    "b": dict(r=8, alpha=4, targets=("q_proj", "k_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "c": dict(r=2, alpha=16, targets=("k_proj", "v_proj", "up_proj")),
    "c2": dict(r=2, alpha=16, targets=("k_proj", "v_proj", "up_proj")),  # "c" reloaded with other weights
}
BS = 16
CFG = dict(
    max_num_seqs=8, max_tokens_per_step=64, block_size=BS, kv_budget_tokens=2048, max_model_len=256, stop_at_eos=False
)
GREEDY = SamplingParams(max_new_tokens=6)
ROUTINGS = ["none", "pinned", "vocab", "learned", "learned_carry", "learned_probe", "arrow"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {n: make_peft_adapter(root / n, "qwen3", seed=i, **s) for i, (n, s) in enumerate(SPECS.items())}


def _mm(paths, router: str = "vocab", arch: str = "qwen3"):
    """A fresh model with adapters a, b, c and the router of a routing mode (seeded by its own generator)."""
    if arch != "qwen3":
        ps = {
            n: make_peft_adapter(paths["a"].parent / f"{arch}_{n}", arch, seed=i, **SPECS[n])
            for i, n in enumerate(("a", "b", "c"))
        }
    else:
        ps = {n: paths[n] for n in ("a", "b", "c")}
    mm = molora.attach(tiny_model(arch), ps, target_modules=LLAMA_PROJECTIONS)
    if router in ("vocab", "none", "pinned"):
        mm.router = VocabRouter([(0, 50, "a"), (50, 90, "b")], default="c")
    elif router.startswith("learned"):
        cfg = LearnedRouterConfig(
            ("b", "a", "c"),
            mm.config.hidden_size,
            len(decoder_layers(mm.model)),
            carry_blocks=0 if router == "learned" else 1,
            probe_prompt=router == "learned_probe",
        )
        mm.router = LearnedRouter(cfg)
        with torch.no_grad():
            mm.router.weight.normal_(generator=torch.Generator().manual_seed(0))
    elif router == "arrow":
        mm.router = ArrowRouter(ArrowConfig(top_k=2)).bind(mm)
    return mm


def _kw(routing: str) -> dict:
    return {"none": dict(routing="none"), "pinned": dict(adapter="b")}.get(routing, dict(routing="auto"))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine: Engine, prompts: list[list[int]], params=GREEDY, **kw) -> list:
    """engine.generate one prompt after the other (each sees the blocks the ones before it published),
    checking the engine's bookkeeping after every step."""
    outs = []
    for p in prompts:
        rid = engine.add_request(p, params, **kw)
        toks, cached = [], None
        while engine.has_unfinished():
            for o in engine.step():
                if o.request_id == rid:
                    toks += o.new_token_ids
                    cached = o.cached_tokens if o.finished else cached
            engine.check()
        outs.append((toks, cached))
    return outs


@pytest.mark.parametrize("routing", ROUTINGS)
@torch.no_grad()
def test_shared_prefix_outputs_equal_cache_off_and_hits_are_counted(paths, routing):
    prefix = _ids(3 * BS, 1)
    prompts = [prefix + _ids(9, 2), prefix + _ids(5, 3), prefix + _ids(9, 2)]
    on = Engine(_mm(paths, routing), EngineConfig(**CFG))
    off = Engine(_mm(paths, routing), EngineConfig(**CFG, enable_prefix_caching=False))
    got, want = _run(on, prompts, **_kw(routing)), _run(off, prompts, **_kw(routing))
    assert [t for t, _ in got] == [t for t, _ in want]
    assert all(len(t) == 6 for t, _ in got)
    assert got[0][1] == 0 and all(c == 0 for _, c in want)
    stats = on.stats()["prefix_cache"]
    if routing == "learned_probe":
        # the probe pass hits on the shared blocks; the real pass of a prompt seen before hits all its full
        # blocks (same probe, same decisions); a different suffix may change the filled decisions: no claim
        assert got[2][1] == 3 * BS and stats["probe_hit_tokens"] >= 2 * 3 * BS
    else:
        assert got[1][1] == 3 * BS and got[2][1] == 3 * BS
    assert stats["hit_tokens"] == sum(c for _, c in got) and stats["queried_tokens"] == sum(map(len, prompts))
    assert stats["cached_blocks"] > 0 and off.stats()["prefix_cache"] == {"enabled": False}


@torch.no_grad()
def test_a_probe_cached_over_the_whole_prompt_skips_the_probe_pass(paths):
    """A block-aligned prompt seen before: its probe decisions all come from the cache (no probe forward),
    its real pass hits all but the last block; the output equals the cache-off engine's."""
    prompt = _ids(3 * BS, 12)
    on = Engine(_mm(paths, "learned_probe"), EngineConfig(**CFG))
    off = Engine(_mm(paths, "learned_probe"), EngineConfig(**CFG, enable_prefix_caching=False))
    (first,) = _run(on, [prompt])
    computed = on.tokens_computed
    (second,) = _run(on, [prompt])
    want = off.generate([prompt, prompt], GREEDY)
    assert [first[0], second[0]] == [w.new_token_ids for w in want]
    stats = on.stats()["prefix_cache"]
    assert stats["probe_hit_tokens"] == 3 * BS and second[1] == 2 * BS
    assert on.tokens_computed - computed == BS + GREEDY.max_new_tokens - 1  # the last block, then decoding


def _together(engine: Engine, prompts: list[list[int]], **kw) -> list:
    """All prompts added at once (one arrival burst), stepped to the end with Engine.check after every step."""
    rids = [engine.add_request(p, GREEDY, **kw) for p in prompts]
    toks: dict[str, list[int]] = {r: [] for r in rids}
    cached: dict[str, int | None] = {}
    while engine.has_unfinished():
        for o in engine.step():
            toks[o.request_id] += o.new_token_ids
            if o.finished:
                cached[o.request_id] = o.cached_tokens
        engine.check()
    return [(toks[r], cached[r]) for r in rids]


@pytest.mark.parametrize("routing", ["pinned", "learned", "learned_probe"])
@torch.no_grad()
def test_requests_arriving_together_compute_their_shared_prefix_once(paths, routing):
    """Four requests with one 4-block system prompt arrive in one burst: the first computes the prefix, the
    others wait for its blocks (they are in flight, not yet cached) and take them from the cache instead of
    computing them again; outputs equal the cache-off engine's."""
    prefix = _ids(4 * BS, 21)
    prompts = [prefix + _ids(7 + i, 30 + i) for i in range(4)]
    cfg = {**CFG, "max_tokens_per_step": 512}  # room for all four prompts in one step
    on = Engine(_mm(paths, routing), EngineConfig(**cfg))
    off = Engine(_mm(paths, routing), EngineConfig(**cfg, enable_prefix_caching=False))
    got, want = _together(on, prompts, **_kw(routing)), _together(off, prompts, **_kw(routing))
    assert [t for t, _ in got] == [t for t, _ in want]
    stats = on.stats()["prefix_cache"]
    if routing == "learned_probe":  # the probe pass of every later request hits the whole system prompt;
        assert stats["probe_hit_tokens"] == 3 * 4 * BS  # the real pass hits where the decisions agree
        assert off.tokens_computed - on.tokens_computed >= 3 * 4 * BS + stats["hit_tokens"]
    else:
        assert [c for _, c in got] == [0] + [4 * BS] * 3
        assert off.tokens_computed - on.tokens_computed == 3 * 4 * BS


@pytest.mark.parametrize("arch", ["llama"])
@torch.no_grad()
def test_llama_pinned_and_vocab_outputs_equal_cache_off(paths, arch):
    prefix = _ids(2 * BS, 4)
    prompts = [prefix + _ids(7, 5), prefix + _ids(3, 6)]
    for routing in ("pinned", "vocab"):
        on = Engine(_mm(paths, routing, arch), EngineConfig(**CFG))
        off = Engine(_mm(paths, routing, arch), EngineConfig(**CFG, enable_prefix_caching=False))
        got, want = _run(on, prompts, **_kw(routing)), _run(off, prompts, **_kw(routing))
        assert [t for t, _ in got] == [t for t, _ in want] and got[1][1] == 2 * BS


@torch.no_grad()
def test_different_adapters_over_the_same_tokens_never_share_kv(paths):
    """Same tokens, other routing: pinned a, pinned b, base, vocab: each computes its own KV (no hit)."""
    prompt = _ids(3 * BS + 4, 7)
    on = Engine(_mm(paths), EngineConfig(**CFG))
    kws = [dict(adapter="a"), dict(adapter="b"), dict(routing="none"), dict(routing="vocab")]
    for kw in kws:
        ((toks, cached),) = _run(on, [prompt], **kw)
        off = Engine(_mm(paths), EngineConfig(**CFG, enable_prefix_caching=False))
        assert toks == off.generate([prompt], GREEDY, **kw)[0].new_token_ids and cached == 0
    ((_, cached),) = _run(on, [prompt], adapter="a")
    assert cached == 3 * BS


@torch.no_grad()
def test_two_turn_chat_serves_turn_one_and_its_answer_from_the_cache(paths):
    turn1 = _ids(40, 8)
    on = Engine(_mm(paths), EngineConfig(**CFG))
    off = Engine(_mm(paths), EngineConfig(**CFG, enable_prefix_caching=False))
    ((answer, _),) = _run(on, [turn1], SamplingParams(max_new_tokens=30), adapter="a")
    turn2 = turn1 + answer + _ids(6, 9)
    ((got, cached),) = _run(on, [turn2], adapter="a")
    assert got == off.generate([turn2], GREEDY, adapter="a")[0].new_token_ids
    assert cached == (len(turn1) + len(answer) - 1) // BS * BS == 64  # the answer's last token was never computed
    assert cached / len(turn2) >= 0.8


@torch.no_grad()
def test_adapter_reload_between_two_requests_never_serves_stale_kv(paths):
    prompt = _ids(2 * BS + 5, 10)
    on = Engine(_mm(paths), EngineConfig(**CFG))
    ((first, _),) = _run(on, [prompt], adapter="c")
    assert on.unload_adapter("c") == "unloaded"
    on.load_adapter("c", paths["c2"])  # same name, other weights
    ((second, cached),) = _run(on, [prompt], adapter="c")
    assert cached == 0
    off = Engine(_mm(paths), EngineConfig(**CFG, enable_prefix_caching=False))
    off.unload_adapter("c")
    off.load_adapter("c", paths["c2"])
    assert second == off.generate([prompt], GREEDY, adapter="c")[0].new_token_ids != first
    ((third, cached),) = _run(on, [prompt], adapter="c")  # the new version's blocks are hits
    assert third == second and cached == 2 * BS
    on.unload_adapter("c")  # the same folder again: a fresh read, a new version
    on.load_adapter("c", paths["c2"])
    ((fourth, cached),) = _run(on, [prompt], adapter="c")
    assert fourth == second and cached == 0


@pytest.mark.parametrize("routing", ["pinned", "learned_probe"])
@torch.no_grad()
def test_outputs_equal_cache_off_across_preemption_and_eviction(paths, routing):
    """A KV pool too small for the batch: requests are preempted (their blocks go to the cache and are found
    again) and cached blocks are evicted; every output equals the cache-off engine's."""
    small = dict(CFG, num_kv_blocks=12, max_tokens_per_step=32, max_model_len=96)
    prefixes = [_ids(2 * BS, 20 + i) for i in range(3)]
    prompts = [prefixes[i % 3] + _ids(3 + i, 30 + i) for i in range(8)]
    params = SamplingParams(max_new_tokens=20)
    on = Engine(_mm(paths, routing), EngineConfig(**small))
    off = Engine(_mm(paths, routing), EngineConfig(**small, enable_prefix_caching=False))
    rids = [on.add_request(p, params, **_kw(routing)) for p in prompts]
    got: dict[str, list[int]] = {r: [] for r in rids}
    while on.has_unfinished():
        for o in on.step():
            got[o.request_id] += o.new_token_ids
        on.check()
    want = off.generate(prompts, params, **_kw(routing))
    assert [got[r] for r in rids] == [w.new_token_ids for w in want]
    stats = on.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache"]["evictions"] > 0
    assert stats["prefix_cache"]["hit_tokens"] > 0
    assert on.allocator.num_free == on.allocator.num_blocks  # everything released (free or cached)


@pytest.mark.parametrize("router", ["vocab", "learned_probe"])
@torch.no_grad()
def test_fuzz_shared_prefixes_routing_modes_and_adapter_churn_equal_cache_off(paths, router):
    """Seeded: waves of requests over a few shared prefixes with random suffixes, lengths, routing modes and
    sampling (seeded), requests added while others run; between waves adapter "c" is swapped between two
    folders. Every output equals the cache-off engine's doing the same."""
    rng = random.Random(1234 if router == "vocab" else 4321)
    cfg = dict(CFG, num_kv_blocks=40, max_tokens_per_step=40, max_model_len=128)
    on = Engine(_mm(paths, router), EngineConfig(**cfg))
    off = Engine(_mm(paths, router), EngineConfig(**cfg, enable_prefix_caching=False))
    prefixes = [_ids(rng.choice([BS, 2 * BS, 2 * BS + 3]), 100 + i) for i in range(4)]
    modes = [
        dict(routing="none"),
        dict(adapter="a"),
        dict(adapter="c"),
        dict(routing="auto"),
        dict(routing="auto", allowed_adapters=["a", "c"]),
    ]
    c_folder = "c"
    hits = 0
    for wave in range(6):
        batch = []
        for i in range(rng.randint(3, 6)):
            prompt = rng.choice(prefixes) + _ids(rng.randint(1, 20), 1000 * wave + i)
            if rng.random() < 0.2:
                prompt = rng.choice(prefixes)[: rng.randint(1, BS)]
            greedy = rng.random() < 0.7
            params = SamplingParams(
                max_new_tokens=rng.randint(1, 12),
                temperature=0.0 if greedy else 0.8,
                seed=None if greedy else rng.randint(0, 99),
            )
            batch.append((prompt, params, rng.choice(modes), rng.randint(0, 3)))
        results = {}
        for engine, name in ((on, "on"), (off, "off")):
            pending = sorted(batch, key=lambda b: b[3])
            got: dict[str, list[int]] = {}
            step = 0
            while pending or engine.has_unfinished():
                while pending and pending[0][3] <= step:
                    prompt, params, kw, _ = pending.pop(0)
                    got[engine.add_request(prompt, params, request_id=f"{wave}-{len(got)}", **kw)] = []
                for o in engine.step():
                    got[o.request_id] += o.new_token_ids
                    hits += o.cached_tokens if o.finished and name == "on" else 0
                engine.check()
                step += 1
            results[name] = got
        assert results["on"] == results["off"], f"wave {wave}"
        c_folder = "c2" if c_folder == "c" else "c"  # adapter churn between waves, on both engines alike
        for engine in (on, off):
            engine.unload_adapter("c")
            engine.load_adapter("c", paths[c_folder])
    assert hits > 0 and on.stats()["prefix_cache"]["hit_tokens"] > 0
    print(on.stats()["prefix_cache"])


def test_allocator_shares_counts_references_and_evicts_least_recently_released_first():
    a = BlockAllocator(4, 2)
    t1: list[int] = []
    assert a.grow(t1, 6) and t1 == [0, 1, 2]
    assert a.publish(0, "k0") and a.publish(1, "k1") and not a.publish(2, "k0")  # a key has one block
    t2: list[int] = []
    a.share(t2, [a.lookup("k0"), a.lookup("k1")])
    assert a.refs(0) == 2 and a.can_grow(t2, 6) and not a.can_grow(t2, 8)
    a.check([t1, t2])
    a.free(t1)
    assert a.refs(0) == 1 and a.num_free == 2  # block 2 (no key) free, 0 and 1 still held
    a.free(t2)
    assert a.num_free == 4 and a.num_cached == 2
    a.check([])
    t3: list[int] = []
    assert a.grow(t3, 6) and a.evictions == 1 and a.lookup("k1") is None and a.lookup("k0") == 0  # the tail went
    t4: list[int] = []
    assert a.can_grow(t4, 2, [0]) and not a.can_grow(t4, 4, [0])  # sharing block 0 takes it from the free count
    a.share(t4, [0])
    a.check([t3, t4])
    a.forget([0])
    a.free(t4)
    a.free(t3)
    assert a.num_cached == 0 and a.num_free == 4
    a.check([])


def test_server_reports_cached_tokens_in_usage_and_metrics(paths):
    import httpx

    from molora.server import ServerThread, create_app
    from tests.test_server import ToyTokenizer

    mm = molora.attach(
        tiny_model("qwen3"),
        {n: paths[n] for n in ("a", "b")},
        tokenizer=ToyTokenizer(),
        target_modules=LLAMA_PROJECTIONS,
    )
    app = create_app(Engine(mm, EngineConfig(**CFG)), model_name="tiny")
    body = {"model": "tiny:a", "prompt": _ids(2 * BS + 8, 11), "max_tokens": 4, "temperature": 0}
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        first = http.post("/completions", json=body).json()
        second = http.post("/completions", json=body).json()
        metrics = httpx.get(url.removesuffix("/v1") + "/metrics").text
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 2 * BS}
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert "molora_prefix_cache_hits_total 32.0" in metrics
    assert f"molora_prefix_cache_queries_total {2.0 * len(body['prompt'])}" in metrics
    assert "molora_prefix_cache_hit_rate" in metrics and "molora_prefix_cache_evictions_total 0.0" in metrics
