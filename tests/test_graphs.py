"""Decode graphs (molora.model.graphs), tested on the CPU through tests/graph_emulator.py: a recorded step replays
its aten ops and no Python, so any value baked in at capture shows up as a wrong replay. Replays must equal the
eager runner whatever the routing, the batch size within a bucket and the adapters loaded since capture."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import molora
from molora.config import LLAMA_PROJECTIONS, SamplingParams
from molora.engine import Engine, EngineConfig
from molora.errors import MoLoRAError
from molora.model.batch import BatchMeta, RouterGroup, StepRouting
from molora.model.runner import ModelRunner
from molora.ops import fused_cpu
from tests.conftest import VOCAB, make_peft_adapter, tiny_model
from tests.graph_emulator import HostReadWhileRecording, emulated_capture

TOL = 1e-4
BF16_TOL = 1e-2  # bf16 GEMMs over a padded batch round differently; an adapter's delta is far larger
BS = 4
SPECS = {
    "a": dict(r=4, alpha=8, targets=("q_proj", "v_proj", "down_proj")),
    "b": dict(r=8, alpha=4, targets=("q_proj", "k_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "c": dict(r=2, alpha=16, targets=("v_proj", "up_proj")),
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {n: make_peft_adapter(root / n, "qwen3", seed=i, **s) for i, (n, s) in enumerate(SPECS.items())}


def _mm(paths, names=(), dtype=torch.float32):
    mm = molora.attach(
        tiny_model("qwen3"),
        {n: paths[n] for n in names},
        slots=4,
        target_modules=LLAMA_PROJECTIONS,
        dispatch="stacked_mask",
        max_rank=8,
    )
    mm.dispatcher.check_ids = False
    return mm.to(dtype)  # after attach: the bank's scale buffers become bf16 too


class _Pair:
    """One eager and one graphed runner over the same model and bank, fed the same steps."""

    def __init__(self, mm, capture=emulated_capture, **kw):
        self.mm = mm
        self.eager = ModelRunner(mm, num_blocks=64, block_size=BS, max_model_len=64)
        self.graphed = ModelRunner(mm, num_blocks=64, block_size=BS, max_model_len=64)
        self.graphs = self.graphed.enable_graphs(capture=capture, buckets=(1, 2, 4, 8), **kw)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self.next_block = 0
        self.last: dict[int, int] = {}

    def _table(self, seq: int, length: int) -> list[int]:
        t = self.tables.setdefault(seq, [])
        while len(t) * BS < length:
            t.append(self.next_block)
            self.next_block += 1
        return list(t)

    def prefill(self, seqs: dict[int, list[int]]):
        for i, toks in seqs.items():
            n = len(toks)
            meta = BatchMeta([n], [n], [self._table(i, n)])
            args = (torch.tensor(toks), torch.arange(n), meta)
            e = self.eager(*args, logits=True).logits
            g = self.graphed(*args, logits=True).logits
            assert (e - g).abs().max() <= TOL
            self.lens[i] = n
            self.last[i] = int(e[0].argmax())

    def decode(self, seqs: list[int], slots: list[list[int]] | None, weights=None, logits=True):
        """One decode step of `seqs` (slots [B][k] per sequence, None: base) on both runners; returns the eager
        and graphed StepOutputs."""
        for i in seqs:
            self.lens[i] += 1
        meta = BatchMeta([1] * len(seqs), [self.lens[i] for i in seqs], [self._table(i, self.lens[i]) for i in seqs])
        tokens = torch.tensor([self.last[i] for i in seqs])
        positions = torch.tensor([self.lens[i] - 1 for i in seqs])
        routing = (
            None
            if slots is None
            else StepRouting(
                torch.tensor(slots), None if weights is None else torch.tensor(weights, dtype=torch.float32)
            )
        )
        with fused_cpu.suspended():  # the same torch ops as the recorded step
            e = self.eager(tokens, positions, meta, routing, logits=logits)
        g = self.graphed(tokens, positions, meta, routing, logits=logits)
        tol = TOL if e.logits.dtype == torch.float32 else BF16_TOL
        assert (e.logits - g.logits).abs().max() <= tol
        assert (e.hidden - g.hidden).abs().max() <= tol
        if slots is not None:
            assert torch.equal(e.last_slot_ids, g.last_slot_ids)
        for j, i in enumerate(seqs):
            self.last[i] = int(e.logits[j].argmax()) if logits is True else self.last[i]
        return e, g


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_replays_follow_the_routing_and_the_adapters_loaded_after_capture(paths):
    """Captured with no adapter loaded (every routed linear inactive), then adapters loaded, routed, rewritten
    and unloaded between replays: each replay equals the eager runner."""
    mm = _mm(paths)
    pair = _Pair(mm)
    pair.prefill({0: _prompt(9, 0), 1: _prompt(10, 1), 2: _prompt(8, 2)})
    pair.decode([0, 1, 2], None)  # captured here: nothing loaded
    assert pair.graphs.captures == 1
    mm.load_adapter("a", paths["a"])
    mm.load_adapter("b", paths["b"])
    pair.decode([0, 1, 2], [[0], [1], [-1]])
    pair.decode([0, 1, 2], [[1], [-1], [0]])
    mm.load_adapter("c", paths["c"])  # slot 2, after capture
    _, g = pair.decode([0, 1, 2], [[2], [2], [0]])
    assert g.last_slot_ids[:, 0].tolist() == [2, 2, 0]
    mm.unload_adapter("a")  # slot 0 zeroed
    pair.decode([0, 1, 2], [[0], [2], [1]])
    assert pair.graphs.replays == 5 and pair.graphs.captures == 1  # contexts 9..15 tokens: 4 blocks throughout


def test_batch_sizes_share_a_bucket_and_padding_rows_write_only_the_scratch_block(paths):
    mm = _mm(paths, ("a", "b"))
    pair = _Pair(mm)
    pair.prefill({i: _prompt(4 + i, 10 + i) for i in range(5)})
    pair.decode([0, 1, 2, 3, 4], [[0], [1], [0], [-1], [1]])  # bucket 8, 3 padding rows
    pair.decode([4, 2, 0], [[1], [1], [0]])  # bucket 4, in another order
    pair.decode([1, 3, 2, 0], [[-1], [0], [1], [1]])  # bucket 4 again: replayed
    pair.decode([3], [[1]])  # bucket 1
    assert pair.graphs.captures == 3 and pair.graphs.replays == 4
    owned = {b for t in pair.tables.values() for b in t}
    kc = pair.graphed.cache.blocks(pair.graphed.cache.k[0])  # [blocks, bs, Hkv, hd]
    others = [b for b in range(kc.shape[0]) if b not in owned and b != pair.graphed.scratch_block]
    assert others and kc[others].abs().max() == 0  # padding rows wrote only the scratch block


def test_contexts_past_a_block_bucket_capture_a_wider_graph(paths):
    mm = _mm(paths, ("a",))
    pair = _Pair(mm)
    pair.prefill({0: _prompt(7, 3), 1: _prompt(2, 4)})
    for _ in range(6):  # 8 .. 13 tokens: 2, then 4 blocks
        pair.decode([0, 1], [[0], [-1]])
    assert [k[1] for k in pair.graphs.graphs] == [2, 4]


def test_weighted_top2_routing(paths):
    mm = _mm(paths, ("a", "b", "c"))
    pair = _Pair(mm, max_top_k=2)
    pair.prefill({0: _prompt(5, 5), 1: _prompt(8, 6), 2: _prompt(2, 7)})
    pair.decode([0, 1, 2], [[0, 1], [2, -1], [1, 2]], [[0.7, 0.3], [1.0, 0.0], [0.5, 0.5]])
    pair.decode([0, 1, 2], [[2, 0], [1, 0], [-1, -1]], [[0.2, 0.8], [0.6, 0.4], [0.0, 0.0]])
    assert pair.graphs.captures == 1 and pair.graphs.replays == 2


def test_bfloat16_bank_scale_is_cast_inside_the_graph(paths):
    """A bf16 model's bank keeps scale in bf16; the routed linears' float32 copy of it is not kept between calls
    while recording, so an adapter loaded after capture (a new scale) is what the replay uses."""
    mm = _mm(paths, ("a",), dtype=torch.bfloat16)
    pair = _Pair(mm)
    pair.prefill({0: _prompt(5, 8), 1: _prompt(4, 9)})
    pair.decode([0, 1], [[0], [0]])
    mm.load_adapter("b", paths["b"])
    pair.decode([0, 1], [[1], [1]])


def test_steps_graphs_do_not_accept_run_eagerly(paths):
    mm = _mm(paths, ("a", "b"))
    pair = _Pair(mm)
    pair.prefill({0: _prompt(5, 11), 1: _prompt(6, 12)})  # prefill: eager
    assert pair.graphs.captures == 0
    pair.decode([0, 1], [[0, 1], [1, 0]], [[0.5, 0.5], [0.5, 0.5]])  # top-2 above max_top_k=1: eager
    assert pair.graphs.captures == 0 and pair.graphs.replays == 0
    other = StepRouting(
        torch.full((2, 1), -1), router=object(), router_slots=torch.tensor([0, 1]), groups=[RouterGroup(None, None)]
    )  # an in-network router, not a LearnedRouter
    assert not pair.graphs.accepts(BatchMeta([1, 1], [7, 8], [[0, 1], [2, 3]]), other)
    assert not pair.graphs.accepts(BatchMeta([1] * 9, [5] * 9, [[0, 1]] * 9), None)  # past the largest bucket


def test_a_capture_that_fails_runs_that_shape_eagerly_and_is_not_retried(paths):
    calls = []

    def broken(step):
        calls.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    mm = _mm(paths, ("a",))
    pair = _Pair(mm, capture=broken)
    pair.prefill({0: _prompt(5, 13)})
    pair.decode([0], [[0]])
    pair.decode([0], [[-1]])
    assert len(calls) == 1 and pair.graphs.failed == [(1, 2, 1, False, None)] and pair.graphs.replays == 0


def test_graphs_need_a_capture_off_cuda_and_a_dispatcher_that_reads_no_ids(paths):
    mm = _mm(paths, ("a",))
    runner = ModelRunner(mm, num_blocks=8, block_size=BS, max_model_len=32)
    with pytest.raises(MoLoRAError, match="captured on CUDA"):
        runner.enable_graphs()
    mm.dispatcher.check_ids = None  # reads ids on the CPU
    with pytest.raises(MoLoRAError, match="check_ids"):
        runner.enable_graphs(capture=emulated_capture)


def test_the_emulator_catches_what_a_cuda_graph_would_bake_in():
    """The tool the other tests rely on fails where a CUDA graph would: a host read while recording raises, and
    a value kept in Python between calls is replayed as it was."""
    x = torch.ones(3)
    with pytest.raises(HostReadWhileRecording):
        emulated_capture(lambda: x * int(x.sum()))
    kept = {}

    def step():
        if "y" not in kept:  # computed at the warm-up, then kept: stale at replay
            kept["y"] = x * 2
        return kept["y"] + x

    replay, out = emulated_capture(step)
    x.fill_(5)
    replay()
    assert out.tolist() == [7.0, 7.0, 7.0]  # 2 (kept) + 5: what a CUDA graph would give, not 15


def _router(mm, names=("b", "a", "c"), seed=0, **kw):
    from molora.routing.learned import LearnedRouter, LearnedRouterConfig, decoder_layers

    cfg = LearnedRouterConfig(names, mm.config.hidden_size, len(decoder_layers(mm.model)), **kw)
    router = LearnedRouter(cfg)
    with torch.no_grad():
        router.weight.normal_(generator=torch.Generator().manual_seed(seed))
    return router


def test_learned_routing_replays_follow_rows_allowed_sets_and_carried_decisions(paths):
    """Per-block learned routing inside the recorded step: which rows the router owns, each group's allowed
    adapters and the carried decisions change between replays (pinned rows keep their slot); replays equal the
    eager runner, carry outputs included."""
    mm = _mm(paths, ("a", "b", "c"))
    router = _router(mm, carry_blocks=1)
    pair = _Pair(mm)
    pair.prefill({i: _prompt(6 + i, 40 + i) for i in range(4)})
    slots = torch.tensor([mm.bank.slot_of(n) for n in router.adapter_names])

    def step(fixed, groups, carry):
        routing = StepRouting(
            torch.tensor(fixed)[:, None],
            router=router,
            router_slots=slots,
            groups=[
                RouterGroup(None if r is None else torch.tensor(r), None if a is None else torch.tensor(a))
                for r, a in groups
            ],
            carry=torch.tensor(carry),
        )
        seqs = list(range(len(fixed)))
        for i in seqs:
            pair.lens[i] += 1
        meta = BatchMeta([1] * len(seqs), [pair.lens[i] for i in seqs], [pair._table(i, pair.lens[i]) for i in seqs])
        tokens, positions = torch.tensor([pair.last[i] for i in seqs]), torch.tensor([pair.lens[i] - 1 for i in seqs])
        with fused_cpu.suspended():
            e = pair.eager(tokens, positions, meta, routing, logits=True)
        g = pair.graphed(tokens, positions, meta, routing, logits=True)
        assert (e.logits - g.logits).abs().max() <= TOL
        assert torch.equal(e.last_slot_ids, g.last_slot_ids)
        assert torch.equal(e.last_carry, g.last_carry) and torch.equal(e.carry_rows, g.carry_rows)
        for j, i in enumerate(seqs):
            pair.last[i] = int(e.logits[j].argmax())
        return e

    a_only, not_c = [False, True, False], [True, True, False]
    step([-1, -1, -1, -1], [(None, None)], [0, 1, -1, 2])  # captured: all learned
    step([-1, 0, -1, -1], [([0, 2], a_only), ([3], not_c)], [1, -2, 2, -2])  # row 1 pinned to slot 0
    e = step([1, -1, -1, 2], [([1, 2], None)], [-2, 0, -2, -2])  # rows 0 and 3 pinned
    assert e.last_slot_ids[:, 0].tolist()[0] == 1 and e.last_slot_ids[:, 0].tolist()[3] == 2
    assert pair.graphs.captures == 1 and pair.graphs.replays == 3
    router.config = dataclasses.replace(router.config, confidence=0.6)  # Python values of the recorded step
    step([-1, -1, -1, -1], [(None, None)], [0, -2, 1, 2])
    assert pair.graphs.captures == 2  # a new config: recorded anew


@pytest.mark.parametrize("probe_prompt", [False, True])
def test_engine_with_a_learned_router_equals_eager_with_graphed_decode(paths, probe_prompt):
    """The engine's learned-routing decode steps replayed from graphs (a carrying router, with and without a
    probe pass), requests of learned routing and pinned adapters in one batch: greedy outputs and each token's
    adapter equal the eager engine's."""
    cfg = EngineConfig(
        max_num_seqs=8, max_tokens_per_step=32, block_size=BS, kv_budget_tokens=512, max_model_len=64, stop_at_eos=False
    )
    prompts = [_prompt(n, 60 + n) for n in (5, 9, 3, 7)]
    adapters = [None, "b", None, None]
    params = [SamplingParams(max_new_tokens=n) for n in (7, 4, 9, 6)]
    outs, stats = [], None
    for graphed in (False, True):
        mm = _mm(paths, ("a", "b", "c"))
        mm.router = _router(mm, carry_blocks=1, probe_prompt=probe_prompt)
        engine = Engine(mm, cfg)
        if graphed:
            engine.runner.enable_graphs(capture=emulated_capture, buckets=(1, 2, 4, 8))
        res = engine.generate(prompts, params, adapter=adapters)
        outs.append([(o.new_token_ids, o.token_adapters) for o in res])
        stats = engine.stats()["decode_graphs"]
        if graphed:
            assert any(key[4] is not None for key in engine.runner.graphs.graphs)  # learned steps were recorded
    assert outs[0] == outs[1]
    assert stats["replays"] > 0 and stats["failed"] == 0
    assert {a for _, ads in outs[1] for a in ads} - {None, "b"}  # the router chose some adapters


def test_engine_greedy_outputs_equal_with_graphed_decode(paths):
    """The engine's decode steps replayed from graphs: per-request pinned adapters and the base in one batch,
    requests joining and finishing (buckets change), outputs equal to the eager engine token for token."""
    cfg = EngineConfig(
        max_num_seqs=8, max_tokens_per_step=64, block_size=BS, kv_budget_tokens=512, max_model_len=64, stop_at_eos=False
    )
    prompts = [_prompt(n, 20 + n) for n in (5, 9, 3, 7, 4)]
    adapters = ["a", "b", None, "c", "a"]
    params = [SamplingParams(max_new_tokens=n) for n in (6, 3, 8, 5, 7)]
    outs = []
    for graphed in (False, True):
        mm = _mm(paths, ("a", "b", "c"))
        engine = Engine(mm, cfg)
        if graphed:
            engine.runner.enable_graphs(capture=emulated_capture, buckets=(1, 2, 4, 8))
        outs.append([o.new_token_ids for o in engine.generate(prompts, params, adapter=adapters)])
    assert outs[0] == outs[1]
    stats = engine.stats()["decode_graphs"]
    assert stats["replays"] > 0 and stats["captured"] >= 2 and stats["failed"] == 0
