"""Engine invariants: outputs equal the transformers reference, batch invariance, seeded sampling, stop
rules, UTF-8-safe streaming, hot-set tiers and pins, and resource safety over many cancel/complete cycles."""

from __future__ import annotations

import pytest
import torch

import molora
from molora.config import LLAMA_PROJECTIONS, SamplingParams
from molora.engine import Engine, EngineConfig
from molora.engine.request import IncrementalDetokenizer, TextState
from molora.errors import AdapterError, MoLoRAError, RoutingError
from molora.routing import SequenceRouter, VocabRouter
from tests.conftest import VOCAB, gen, make_peft_adapter, tiny_model

ARCH = "qwen3"
SPECS = {
    "a": dict(r=4, alpha=8, targets=("q_proj", "v_proj", "down_proj")),
    "b": dict(r=8, alpha=4, targets=("q_proj", "k_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "c": dict(r=2, alpha=16, targets=("v_proj", "up_proj")),
}
CFG = EngineConfig(
    max_num_seqs=8, max_tokens_per_step=48, block_size=4, kv_budget_tokens=1024, max_model_len=128, stop_at_eos=False
)
GREEDY = SamplingParams(max_new_tokens=6)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {n: make_peft_adapter(root / n, ARCH, seed=i, **s) for i, (n, s) in enumerate(SPECS.items())}


def _mm(paths, names=("a", "b", "c"), **kw):
    router = VocabRouter([(0, 50, "a"), (50, 90, "b")], default="c")
    return molora.attach(
        tiny_model(ARCH), {n: paths[n] for n in names}, router=router, target_modules=LLAMA_PROJECTIONS, **kw
    )


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class ByteTokenizer:
    """Token id -> one byte: ids < 64 are ASCII letters and digits, others UTF-8 lead/continuation bytes."""

    TABLE = (
        [ord(c) for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,!?\n"][:64]
        + [0xC3, 0xE2, 0xF0] * 4
        + list(range(0x80, 0x80 + 52))
    )

    def decode(self, ids, skip_special_tokens=True):
        return bytes(self.TABLE[i] for i in ids).decode("utf-8", errors="replace")


# ------------------------------------------------------------------------------------------ exactness


@torch.no_grad()
def test_greedy_outputs_equal_molora_generate_for_each_routing_mode(paths):
    mm = _mm(paths)
    engine = Engine(mm, CFG)
    prompts = [_prompt(9, 1), _prompt(5, 2), _prompt(13, 3)]
    outs = engine.generate(prompts, GREEDY, adapter=["a", None, "b"], routing=["auto", "vocab", "sequence"])
    for p, out, spec in zip(prompts, outs, ["a", mm.router, "b"]):
        ref = mm.generate(torch.tensor([p]), adapter_ids=spec, max_new_tokens=6)[0, len(p) :]
        assert out.new_token_ids == ref.tolist()
        assert out.finish_reason == "length" and out.completion_tokens == 6 and out.prompt_tokens == len(p)
    assert outs[0].token_adapters == ["a"] * 6
    # vocab routing: the input token that emitted each new token decides its adapter
    feed = [prompts[1][-1]] + outs[1].new_token_ids[:-1]
    expect = ["a" if t < 50 else "b" if t < 90 else "c" for t in feed]
    assert outs[1].token_adapters == expect
    base = engine.generate([prompts[0]], GREEDY, routing="none")[0]
    ref = mm.generate(torch.tensor([prompts[0]]), adapter_ids=SequenceRouter(None), max_new_tokens=6)[0, 9:]
    assert base.new_token_ids == ref.tolist() and base.token_adapters == [None] * 6


@torch.no_grad()
def test_batch_invariance_alone_or_in_a_busy_batch_with_chunking_and_preemption(paths):
    probe = _prompt(30, 7)
    alone = Engine(_mm(paths), CFG).generate([probe], SamplingParams(max_new_tokens=10), adapter="b")[0]
    # tiny budget (chunked prefill) and a KV cache of 36 blocks: the busy batch must preempt
    busy_cfg = EngineConfig(
        max_num_seqs=8, max_tokens_per_step=16, block_size=4, num_kv_blocks=36, max_model_len=128, stop_at_eos=False
    )
    engine = Engine(_mm(paths), busy_cfg)
    others = [_prompt(20 + i, 10 + i) for i in range(5)]
    routing = [dict(adapter="a"), dict(routing="vocab"), dict(adapter="c"), dict(routing="none"), {}]
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=12), **kw) for p, kw in zip(others, routing)]
    rid = engine.add_request(probe, SamplingParams(max_new_tokens=10), adapter="b")
    got: dict[str, list[int]] = {i: [] for i in ids + [rid]}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        engine.scheduler.check()
    assert got[rid] == alone.new_token_ids
    assert engine.stats()["num_preemptions"] > 0
    assert engine.allocator.num_free == 36


def test_same_seed_same_sampled_output_in_any_batch(paths):
    engine = Engine(_mm(paths), CFG)
    sp = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9, top_k=40, seed=123)
    first = engine.generate([_prompt(6, 1)], sp, adapter="a")[0].new_token_ids
    crowd = [_prompt(6 + i, 20 + i) for i in range(3)]
    outs = engine.generate(
        [_prompt(6, 1)] + crowd,
        [sp] + [SamplingParams(temperature=0.7, seed=i) for i in range(3)],
        adapter=["a", "b", "c", "a"],
    )
    assert outs[0].new_token_ids == first
    other = engine.generate([_prompt(6, 1)], SamplingParams(max_new_tokens=8, temperature=1.0, seed=7), adapter="a")
    assert other[0].new_token_ids != first


def test_logprobs_report_the_chosen_token_and_top_n(paths):
    out = Engine(_mm(paths), CFG).generate([_prompt(5, 3)], SamplingParams(max_new_tokens=3, logprobs=4))[0]
    assert len(out.logprobs) == 3
    for tok, lp in zip(out.new_token_ids, out.logprobs):
        assert lp["token_id"] == tok and len(lp["top"]) == 4
        assert lp["top"][0][0] == tok and abs(lp["top"][0][1] - lp["logprob"]) < 1e-6  # greedy = top-1


# ------------------------------------------------------------------------------------------ stop rules, text


def test_max_tokens_stop_token_ids_and_stop_strings(paths):
    tok = ByteTokenizer()
    engine = Engine(_mm(paths), CFG, tokenizer=tok)
    prompt = _prompt(6, 4)
    full = engine.generate([prompt], SamplingParams(max_new_tokens=12), adapter="a")[0]
    assert full.completion_tokens == 12 and full.finish_reason == "length"
    assert full.new_text == tok.decode(full.new_token_ids)
    stop_id = full.new_token_ids[4]
    cut = full.new_token_ids.index(stop_id)
    by_id = engine.generate([prompt], SamplingParams(max_new_tokens=12, stop_token_ids=(stop_id,)), adapter="a")[0]
    assert by_id.new_token_ids == full.new_token_ids[: cut + 1] and by_id.finish_reason == "stop"
    text = full.new_text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=12, stop=(stop,)), adapter="a")
    pieces, last = [], None
    while engine.has_unfinished():
        for out in engine.step():
            pieces.append(out.new_text)
            last = out
    assert last.request_id == rid and last.finish_reason == "stop"
    assert "".join(pieces) == text[: text.index(stop)]
    assert all(stop not in p for p in pieces)


def test_streaming_detokenizer_never_splits_a_utf8_character():
    class Bytes:
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    text = "héllo € 𝄞 wörld — ✓"
    data = list(text.encode())
    detok = IncrementalDetokenizer(Bytes(), list(b"ok "))
    pieces = [detok.add(b) for b in data] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert sum(1 for p in pieces if p) < len(data)  # multi-byte characters were held back, then emitted whole


def test_engine_stream_of_byte_tokens_equals_whole_decode(paths):
    tok = ByteTokenizer()
    engine = Engine(_mm(paths), CFG, tokenizer=tok)
    rid = engine.add_request(_prompt(5, 9), SamplingParams(max_new_tokens=40, temperature=1.5, seed=3), adapter="b")
    ids, pieces = [], []
    while engine.has_unfinished():
        for out in engine.step():
            ids += out.new_token_ids
            pieces.append(out.new_text)
    assert out.request_id == rid and out.finished
    assert "".join(pieces) == tok.decode(ids)
    assert all(not p.endswith("\ufffd") for p in pieces[:-1] if p)  # only the end may hold a broken tail


def test_text_state_holds_back_a_possible_stop_prefix():
    st = TextState(("END",))
    assert not st.append("abcE") and st.emit(False) == "ab"
    assert not st.append("N") and st.emit(False) == "c"
    assert st.append("Dxyz") and st.text == "abcE"[:3] and st.emit(True) == ""


# ------------------------------------------------------------------------------------------ hot set


def test_hot_set_lru_eviction_pins_and_counters(paths):
    mm = _mm(paths, names=("a", "b"), slots=2)
    engine = Engine(mm, EngineConfig(**{**CFG.__dict__, "cpu_tier_bytes": 1 << 20}))
    engine.load_adapter("c", str(paths["c"]))  # no free slot: it waits in the CPU tier
    tiers = {d["name"]: d["tier"] for d in engine.list_adapters()}
    assert tiers == {"a": "slot", "b": "slot", "c": "cpu"}
    engine.generate([_prompt(4, 1)], GREEDY, adapter="a")
    engine.generate([_prompt(4, 2)], GREEDY, adapter="b")  # LRU order now: a, b
    engine.generate([_prompt(4, 3)], GREEDY, adapter="c")  # miss: evicts a
    tiers = {d["name"]: d["tier"] for d in engine.list_adapters()}
    assert tiers == {"a": "cpu", "b": "slot", "c": "slot"}
    hs = engine.stats()["hotset"]
    assert (hs["hits"], hs["misses"], hs["evictions"]) == (2, 1, 1) and hs["load_ms_total"] > 0
    # b is least recently used but pinned by a running request: a's promotion must evict c instead
    long = engine.add_request(_prompt(4, 5), SamplingParams(max_new_tokens=50), adapter="b")
    engine.step()
    engine.generate([_prompt(4, 6)], GREEDY, adapter="a")
    assert {d["name"]: d["slot"] is not None for d in engine.list_adapters()} == {"a": True, "b": True, "c": False}
    # both slots pinned: a request for c waits until one frees
    engine.add_request(_prompt(4, 7), SamplingParams(max_new_tokens=50), adapter="a")
    engine.step()
    engine.add_request(_prompt(4, 8), GREEDY, adapter="c")
    engine.step()
    assert engine.stats()["num_waiting"] == 1
    engine.abort(long)
    engine.step()
    assert engine.stats()["num_waiting"] == 0 and engine.hotset.tier("c") == "slot"
    while engine.has_unfinished():
        engine.step()
    assert engine.unload_adapter("b") == "unloaded"
    assert [d["name"] for d in engine.list_adapters()] == ["a", "c"]


def test_cpu_tier_budget_drops_lru_adapters_back_to_disk(paths):
    mm = _mm(paths, names=("a",), slots=1)
    engine = Engine(mm, EngineConfig(**{**CFG.__dict__, "cpu_tier_bytes": 1}))  # nothing fits: disk only
    engine.load_adapter("b", str(paths["b"]))
    reads = engine.hotset.disk_reads
    for name in ("b", "a", "b"):
        engine.generate([_prompt(4, 1)], GREEDY, adapter=name)
    assert engine.hotset.disk_reads == reads + 3 and engine.stats()["hotset"]["cpu_tier_bytes"] == 0


def test_vanished_adapter_folder_aborts_only_its_request(paths, tmp_path):
    import shutil

    mm = _mm(paths, names=("a",), slots=1)
    engine = Engine(mm, EngineConfig(**{**CFG.__dict__, "cpu_tier_bytes": 0}))
    shutil.copytree(paths["b"], tmp_path / "b")
    engine.load_adapter("b", str(tmp_path / "b"))  # validated, but no free slot and no CPU tier
    queued = engine.add_request(_prompt(4, 1), GREEDY, adapter="b")
    shutil.rmtree(tmp_path / "b")
    ok = engine.add_request(_prompt(4, 2), GREEDY, adapter="a")
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
    assert outs[queued].finish_reason == "abort" and outs[ok].finish_reason == "length"
    assert "'b'" in outs[queued].error and str(tmp_path / "b") in outs[queued].error
    engine.scheduler.check()
    assert not engine.hotset.pins


def test_runtime_loaded_adapter_equals_attach_time_adapter(paths):
    engine = Engine(_mm(paths, names=("a",)), CFG)
    engine.load_adapter("c", str(paths["c"]))
    with pytest.raises(AdapterError, match="already loaded"):
        engine.load_adapter("c", str(paths["c"]))
    got = engine.generate([_prompt(7, 2)], GREEDY, adapter="c")[0].new_token_ids
    ref = Engine(_mm(paths), CFG).generate([_prompt(7, 2)], GREEDY, adapter="c")[0].new_token_ids
    assert got == ref


# ------------------------------------------------------------------------------------------ learned routing


class StandInRouter:
    """The learned-router interface: adapter by the sign of a hidden feature of the block, in router order."""

    in_network = True
    adapter_names = ["b", "a"]

    def decide(self, block, hidden, allowed=None):
        score = torch.stack([hidden[:, 3 + block], -hidden[:, 3 + block]], -1)  # [T, K]
        if allowed is not None:
            score = score.masked_fill(~allowed, float("-inf"))
        return score.argmax(-1, keepdim=True), None


def test_learned_routing_in_a_mixed_batch_respects_allowed_adapters(paths):
    mm = _mm(paths)
    mm.router = StandInRouter()
    engine = Engine(mm, CFG)
    p = _prompt(11, 5)
    alone = engine.generate([p], GREEDY)[0]
    assert set(alone.token_adapters) <= {"a", "b"}
    outs = engine.generate(
        [p, p, _prompt(8, 6)], GREEDY, allowed_adapters=[None, ["a"], None], routing=["learned", "learned", "auto"]
    )
    assert outs[0].new_token_ids == alone.new_token_ids and outs[0].token_adapters == alone.token_adapters
    assert set(outs[1].token_adapters) == {"a"}
    with pytest.raises(RoutingError, match="VocabRouter"):
        engine.add_request(p, GREEDY, routing="vocab")


def test_learned_requests_with_different_allowed_sets_share_one_decision_per_block(paths):
    """Requests with four different allowed sets in one batch: each gets the tokens and adapters it gets alone, and
    the router decides once per block for all of them (one group with a mask per row), not once per set."""
    mm = _mm(paths)
    router = mm.router = StandInRouter()
    engine = Engine(mm, CFG)
    sets = [None, ["a"], ["b"], ["b", "a"]]
    prompts = [_prompt(11, 5), _prompt(9, 7), _prompt(11, 5), _prompt(6, 8)]
    alone = [engine.generate([p], GREEDY, allowed_adapters=[a])[0] for p, a in zip(prompts, sets)]
    calls: list[int] = []
    decide = router.decide
    router.decide = lambda block, hidden, allowed=None: calls.append(hidden.shape[0]) or decide(block, hidden, allowed)
    steps = engine.steps
    outs = engine.generate(prompts, GREEDY, allowed_adapters=sets, routing=["learned"] * 4)
    for got, ref, a in zip(outs, alone, sets):
        assert got.new_token_ids == ref.new_token_ids and got.token_adapters == ref.token_adapters
        assert a is None or set(got.token_adapters) <= set(a)
    assert set(outs[1].token_adapters) == {"a"} and set(outs[2].token_adapters) == {"b"}
    assert len(prompts) in calls  # a decode step: the four sets' rows in one call
    assert len(calls) == (engine.steps - steps) * mm.config.num_hidden_layers  # once per block and step


# ------------------------------------------------------------------------------------------ safety


def test_bad_requests_are_refused_and_change_nothing(paths):
    engine = Engine(_mm(paths), CFG)
    before = engine.stats()
    with pytest.raises(AdapterError, match="unknown adapter"):
        engine.add_request([5, 6], GREEDY, adapter="nope")
    with pytest.raises(MoLoRAError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(MoLoRAError, match="max_model_len"):
        engine.add_request([5] * 129, GREEDY)
    with pytest.raises(MoLoRAError, match="vocabulary"):
        engine.add_request([5, VOCAB], GREEDY)
    with pytest.raises(RoutingError, match="allowed_adapters"):
        engine.add_request([5], GREEDY, adapter="a", allowed_adapters=["b"])
    with pytest.raises(MoLoRAError, match="tokenizer"):
        engine.add_request([5], SamplingParams(stop=("x",)))
    assert engine.stats() == before and not engine.has_unfinished()


def test_thousand_cancel_and_complete_cycles_leave_pools_as_at_start(paths):
    """1,000 requests in rounds of 10: 3 cancelled before scheduling, 3 cancelled mid-flight, 4 completed."""
    engine = Engine(_mm(paths, slots=3), CFG)
    free0 = engine.allocator.num_free
    names = ["a", "b", "c", None]
    for rnd in range(100):
        ids = []
        for j in range(10):
            i = rnd * 10 + j
            kw = {"adapter": names[i % 4]} if i % 4 != 3 else {"routing": "vocab"}
            ids.append(engine.add_request(_prompt(3 + i % 5, i % 17), SamplingParams(max_new_tokens=1 + i % 2), **kw))
        for rid in ids[:3]:
            engine.abort(rid)  # before it was scheduled
        engine.step()
        for rid in ids[3:6]:
            engine.abort(rid)  # mid-flight (or just finished: a no-op)
        engine.scheduler.check()
        while engine.has_unfinished():
            engine.step()
        assert engine.allocator.num_free == free0 and not engine.hotset.pins and not engine.requests
    assert engine.stats()["steps"] < 400


@torch.no_grad()
@pytest.mark.parametrize("probe_prompt", [False, True])
def test_carrying_learned_router_equals_generate_alone_busy_and_preempted(paths, probe_prompt):
    """A LearnedRouter with carry_blocks (and with a probe pass over the prompt): the engine's greedy output
    equals `mm.generate`'s, alone and in a busy, chunked, preempting batch (the carried and probed decisions
    are kept per request and survive recompute)."""
    from molora.routing.learned import LearnedRouter, LearnedRouterConfig, decoder_layers

    def routed_mm(probe_prompt=probe_prompt):
        mm = _mm(paths)
        cfg = LearnedRouterConfig(
            ("b", "a"), mm.config.hidden_size, len(decoder_layers(mm.model)), carry_blocks=1, probe_prompt=probe_prompt
        )
        router = LearnedRouter(cfg)
        with torch.no_grad():
            router.weight.normal_(generator=torch.Generator().manual_seed(0))
        mm.router = router
        return mm

    probe = _prompt(26, 8)
    mm = routed_mm()
    ref = mm.generate(torch.tensor([probe]), adapter_ids=mm.router, max_new_tokens=10)[0, len(probe) :].tolist()
    if probe_prompt:  # the probe changes this output, so the comparisons below can tell probing from not
        other = routed_mm(False)
        assert (
            other.generate(torch.tensor([probe]), adapter_ids=other.router, max_new_tokens=10)[0, len(probe) :].tolist()
            != ref
        )
    alone = Engine(mm, CFG).generate([probe], SamplingParams(max_new_tokens=10))[0]
    assert alone.new_token_ids == ref
    assert set(alone.token_adapters) <= {"a", "b", None}
    busy_cfg = EngineConfig(
        max_num_seqs=8, max_tokens_per_step=16, block_size=4, num_kv_blocks=32, max_model_len=128, stop_at_eos=False
    )
    engine = Engine(routed_mm(), busy_cfg)
    others = [engine.add_request(_prompt(20 + i, 30 + i), SamplingParams(max_new_tokens=20)) for i in range(5)]
    rid = engine.add_request(probe, SamplingParams(max_new_tokens=10))
    got: dict[str, list[int]] = {i: [] for i in others + [rid]}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    assert got[rid] == ref
    assert engine.stats()["num_preemptions"] > 0


def test_greedy_picks_the_first_maximum_like_argmax():
    from molora.sampling import greedy

    for dtype in (torch.float32, torch.bfloat16):
        x = torch.zeros(3, 50, dtype=dtype)
        x[:, 7] = x[:, 9] = 1.0  # ties: the first index wins, as in argmax
        x[1, 40] = float("inf")
        x[2, 30] = float("nan")  # a NaN row: argmax and max agree on the NaN's index
        assert torch.equal(greedy(x), x.argmax(-1)) and greedy(x).tolist() == [7, 40, 30]
        y = torch.randn(32, 4096, generator=gen(0)).to(dtype)
        assert torch.equal(greedy(y), y.argmax(-1))
