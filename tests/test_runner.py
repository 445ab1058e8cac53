"""The lean runner equals transformers: prefill, chunked prefill and decode over the paged cache, with and
without adapters, per-token routing equal to MoLoRAModel's forward, and per-block in-network routing."""

from __future__ import annotations

import pytest
import torch

import molora
from molora.model.batch import BatchMeta, RouterGroup, StepRouting
from molora.model.runner import ModelRunner
from tests.conftest import VOCAB, gen, make_peft_adapter, random_model, tiny_model

pytestmark = pytest.mark.usefixtures("panels_where_built")  # the panel-packed paths on every CPU

TOL = 1e-4
SPECS = {
    "a": dict(r=4, alpha=8, targets=("q_proj", "v_proj", "down_proj")),
    "b": dict(r=8, alpha=4, targets=("q_proj", "k_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
}


@pytest.fixture
def mm(tmp_path, arch):
    paths = {n: make_peft_adapter(tmp_path / n, arch, seed=i, **s) for i, (n, s) in enumerate(SPECS.items())}
    return molora.attach(tiny_model(arch), paths)


def _seq(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _route(n: int, seed: int, k: int = 2) -> torch.Tensor:
    return torch.randint(-1, k, (n,), generator=torch.Generator().manual_seed(100 + seed))


@torch.no_grad()
def _reference(mm, ids: torch.Tensor, route: torch.Tensor | None) -> torch.Tensor:
    """Last-token logits [V] of the attached transformers model over the whole sequence."""
    r = torch.full_like(ids, -1) if route is None else route
    return mm(ids[None], adapter_ids=r[None]).logits[0, -1]


def _slots(mm, route: torch.Tensor) -> torch.Tensor:
    return mm.slot_routing(molora.Routing(route[None]), torch.Size([1, route.shape[0]]))[0]  # [T, 1]


class _Pager:
    """Minimal block bookkeeping for the tests: consecutive blocks per sequence."""

    def __init__(self, bs: int) -> None:
        self.bs, self.next, self.tables = bs, 0, {}

    def table(self, seq: int, length: int) -> list[int]:
        t = self.tables.setdefault(seq, [])
        while len(t) * self.bs < length:
            t.append(self.next)
            self.next += 1
        return list(t)


@pytest.mark.parametrize("merge", [0, 256])
@pytest.mark.parametrize("adapters", [False, True])
def test_one_step_prefill_of_ragged_batch_equals_transformers(mm, adapters, merge, monkeypatch):
    """Fresh prompts of several lengths in one step, each length one causal call (the default) or all of them
    merged under a block-diagonal mask (MERGE_PREFILL_TOKENS on): logits as transformers gives each alone."""
    import molora.model.runner as runner_module

    monkeypatch.setattr(runner_module, "MERGE_PREFILL_TOKENS", merge)
    runner = ModelRunner(mm, num_blocks=32, block_size=4, max_model_len=64)
    lens = [5, 9, 1, 4]
    seqs = [_seq(n, i) for i, n in enumerate(lens)]
    routes = [_route(n, i) if adapters else None for i, n in enumerate(lens)]
    pager = _Pager(4)
    meta = BatchMeta(lens, lens, [pager.table(i, n) for i, n in enumerate(lens)])
    plan = runner.plan(torch.cat([torch.arange(n) for n in lens]), meta)
    assert sum(p.mask is not None for p in plan.prefill) == (1 if merge else 0)  # the one merged call, or none
    routing = StepRouting(torch.cat([_slots(mm, r) for r in routes])) if adapters else None
    logits = runner(torch.cat(seqs), torch.cat([torch.arange(n) for n in lens]), meta, routing, logits=True).logits
    for i, s in enumerate(seqs):
        assert (logits[i] - _reference(mm, s, routes[i])).abs().max() <= TOL


@pytest.mark.parametrize("lens, sizes", [([90, 90, 40, 90], [3, 1]), ([80, 80, 80, 80], [4])])
def test_fresh_prompts_of_one_length_share_a_batched_causal_call(mm, lens, sizes):
    """Unmerged (MERGE_PREFILL_TOKENS, off by default, or more tokens than it), fresh prompts of one length run as one
    [P, H, n, hd] causal call:
    rows adjacent in the step (a slice) or not (an index: a 40-token prompt lies between); logits as
    transformers gives each sequence alone."""
    from molora.model.batch import MERGE_PREFILL_TOKENS

    assert sum(lens) > MERGE_PREFILL_TOKENS
    runner = ModelRunner(mm, num_blocks=96, block_size=4, max_model_len=128)
    seqs = [_seq(n, i) for i, n in enumerate(lens)]
    routes = [_route(n, i) for i, n in enumerate(lens)]
    pager = _Pager(4)
    meta = BatchMeta(lens, lens, [pager.table(i, n) for i, n in enumerate(lens)])
    plan = runner.plan(torch.cat([torch.arange(n) for n in lens]), meta)
    assert [p.count for p in plan.prefill if p.mask is None] == sizes  # a prompt alone is a call of one
    logits = runner(
        torch.cat(seqs),
        torch.cat([torch.arange(n) for n in lens]),
        meta,
        StepRouting(torch.cat([_slots(mm, r) for r in routes])),
        logits=True,
    ).logits
    for i, s in enumerate(seqs):
        assert (logits[i] - _reference(mm, s, routes[i])).abs().max() <= TOL


def test_chunked_prefill_and_decode_over_paged_cache_equal_transformers(mm):
    """Two sequences advance together: one in prefill chunks, the other decoding; every step's logits
    equal a full forward over the sequence so far. Blocks are interleaved to exercise the paging."""
    runner = ModelRunner(mm, num_blocks=32, block_size=4, max_model_len=64)
    a, b = _seq(14, 1), _seq(3, 2)
    ra, rb = _route(40, 1), _route(40, 2)
    pager = _Pager(4)
    done_a, done_b = 0, 0
    plan_a = [5, 6, 3, 1, 1, 1]  # prefill chunks then decode
    for step, na in enumerate(plan_a):
        nb = 3 if step == 0 else 1
        if done_a + na > a.shape[0]:
            a = torch.cat([a, _seq(1, 50 + step)])
        if done_b + nb > b.shape[0]:
            b = torch.cat([b, _seq(1, 70 + step)])
        ta, tb = a[done_a : done_a + na], b[done_b : done_b + nb]
        pa, pb = torch.arange(done_a, done_a + na), torch.arange(done_b, done_b + nb)
        meta = BatchMeta(
            [na, nb], [done_a + na, done_b + nb], [pager.table(0, done_a + na), pager.table(1, done_b + nb)]
        )
        slots = torch.cat([_slots(mm, ra[pa]), _slots(mm, rb[pb])])
        logits = runner(torch.cat([ta, tb]), torch.cat([pa, pb]), meta, StepRouting(slots), logits=True).logits
        done_a, done_b = done_a + na, done_b + nb
        assert (logits[0] - _reference(mm, a[:done_a], ra[:done_a])).abs().max() <= TOL, step
        assert (logits[1] - _reference(mm, b[:done_b], rb[:done_b])).abs().max() <= TOL, step


def test_top2_weighted_routing_equals_molora_forward(mm):
    runner = ModelRunner(mm, num_blocks=8, block_size=8, max_model_len=64)
    ids = _seq(7, 3)
    route = torch.stack([torch.zeros(7, dtype=torch.long), torch.ones(7, dtype=torch.long)], -1)  # [T, 2]
    w = torch.softmax(torch.randn(7, 2, generator=torch.Generator().manual_seed(0)), -1)
    slots, ww = mm.slot_routing(molora.Routing(route[None], w[None]), torch.Size([1, 7]))
    ours = runner(ids, torch.arange(7), BatchMeta([7], [7], [[0]]), StepRouting(slots, ww), logits=True).logits[0]
    with torch.no_grad():
        ref = mm(ids[None], adapter_ids=route[None], adapter_weights=w[None]).logits[0, -1]
    assert (ours - ref).abs().max() <= TOL


class BlockRouter:
    """Stand-in for the learned router: per block, adapter = sign of a hidden feature (router order b, a),
    restricted by `allowed`; block 1 keeps block 0's decision (returns None). Records what it saw."""

    in_network = True
    adapter_names = ["b", "a"]

    def __init__(self) -> None:
        self.seen: list[tuple[int, torch.Tensor]] = []

    def decide(self, block, hidden, allowed=None):
        self.seen.append((block, hidden.clone()))
        if block % 2 == 1:
            return None
        score = torch.stack([hidden[:, block], -hidden[:, block], torch.zeros_like(hidden[:, 0])], -1)  # [T, 3]
        if allowed is not None:
            score[:, :2] = score[:, :2].masked_fill(~allowed, float("-inf"))
        top = score.argmax(-1, keepdim=True)
        return torch.where(top == 2, -1, top), None


@torch.no_grad()
def _hooked_reference(mm, ids: torch.Tensor, router: BlockRouter, allowed) -> torch.Tensor:
    """transformers forward where a pre-hook on each block lets the stand-in decide (test-only hooks)."""
    lookup = torch.tensor([mm.bank.slot_of(n) for n in router.adapter_names] + [-1])
    handles = []
    for i, layer in enumerate(mm.model.model.layers):

        def hook(module, args, kwargs, i=i):
            h = (args[0] if args else kwargs["hidden_states"]).reshape(-1, mm.config.hidden_size)
            out = router.decide(i, h, allowed)
            if out is not None:
                mm.context.set(lookup[out[0]])

        handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        return mm.model(input_ids=ids[None]).logits[0, -1]
    finally:
        for hd in handles:
            hd.remove()
        mm.context.clear()


def test_in_network_router_decides_per_block_like_hooked_transformers(mm):
    runner = ModelRunner(mm, num_blocks=16, block_size=4, max_model_len=64)
    x, y = _seq(6, 4), _seq(5, 5)
    router = BlockRouter()
    slots = torch.tensor([mm.bank.slot_of(n) for n in router.adapter_names])
    only_a = torch.tensor([False, True])
    fixed = torch.full((11, 1), -1)
    fixed[6:] = mm.bank.slot_of("b")  # y's rows: pinned unless a group claims them
    routing = StepRouting(
        fixed,
        router=router,
        router_slots=slots,
        groups=[RouterGroup(torch.arange(6), None), RouterGroup(torch.arange(6, 11), only_a)],
    )
    out = runner(
        torch.cat([x, y]),
        torch.cat([torch.arange(6), torch.arange(5)]),
        BatchMeta([6, 5], [6, 5], [[0, 1], [2, 3]]),
        routing,
        logits=True,
    )
    logits = out.logits
    assert [b for b, _ in router.seen] == [0, 0, 1, 1]
    assert (logits[0] - _hooked_reference(mm, x, BlockRouter(), None)).abs().max() <= TOL
    assert (logits[1] - _hooked_reference(mm, y, BlockRouter(), only_a)).abs().max() <= TOL
    assert set(out.last_slot_ids[1].tolist()) <= {-1, mm.bank.slot_of("a")}


@pytest.mark.parametrize("kind", ["mistral_window", "qwen2_bias"])
def test_mistral_sliding_window_and_qwen2_bias_equal_transformers(kind):
    from transformers import MistralConfig, Qwen2Config

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    cfg = MistralConfig(sliding_window=5, **common) if kind == "mistral_window" else Qwen2Config(**common)
    model = random_model(cfg, seed=0)
    if kind == "qwen2_bias":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    mm = molora.attach(model)
    runner = ModelRunner(mm, num_blocks=16, block_size=4, max_model_len=64)
    a, b = _seq(9, 1), _seq(4, 2)
    logits = runner(
        torch.cat([a, b]),
        torch.cat([torch.arange(9), torch.arange(4)]),
        BatchMeta([9, 4], [9, 4], [[0, 1, 2], [3]]),
        logits=True,
    ).logits
    nxt = logits.argmax(-1)
    step = runner(nxt, torch.tensor([9, 4]), BatchMeta([1, 1], [10, 5], [[0, 1, 2], [3, 4]]), logits=True).logits
    with torch.no_grad():
        for i, s in enumerate((a, b)):
            assert (logits[i] - model(input_ids=s[None]).logits[0, -1]).abs().max() <= TOL
            full = torch.cat([s, nxt[i : i + 1]])
            assert (step[i] - model(input_ids=full[None]).logits[0, -1]).abs().max() <= TOL


def test_sliding_window_in_a_batched_causal_call_equals_transformers():
    from transformers import MistralConfig

    cfg = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=5,
    )
    model = random_model(cfg, seed=0)
    runner = ModelRunner(molora.attach(model), num_blocks=80, block_size=4, max_model_len=160)
    seqs = [_seq(150, 1), _seq(150, 2)]
    pager = _Pager(4)
    meta = BatchMeta([150, 150], [150, 150], [pager.table(i, 150) for i in range(2)])
    assert [p.count for p in runner.plan(torch.arange(150).repeat(2), meta).prefill] == [2]
    logits = runner(torch.cat(seqs), torch.arange(150).repeat(2), meta, logits=True).logits
    with torch.no_grad():
        for i, s in enumerate(seqs):
            assert (logits[i] - model(input_ids=s[None]).logits[0, -1]).abs().max() <= TOL


def test_bf16_runner_stays_close_to_bf16_transformers(mm):
    mm.to(torch.bfloat16)
    runner = ModelRunner(mm, num_blocks=8, block_size=4, max_model_len=64)
    ids, route = _seq(10, 8), _route(10, 8)
    ours = (
        runner(ids, torch.arange(10), BatchMeta([10], [10], [[0, 1, 2]]), StepRouting(_slots(mm, route)), logits=True)
        .logits[0]
        .float()
    )
    ref = _reference(mm, ids, route).float()
    assert ours.dtype == torch.float32 and (ours - ref).abs().max() <= 0.05 * ref.abs().max()


def test_unsupported_architecture_and_overlong_context_are_refused(mm):
    runner = ModelRunner(mm, num_blocks=4, block_size=4, max_model_len=8)
    with pytest.raises(molora.MoLoRAError, match="max_model_len"):
        runner(_seq(9, 0), torch.arange(9), BatchMeta([9], [9], [[0, 1, 2]]))
    mm.model.config.model_type = "gpt2"
    with pytest.raises(molora.MoLoRAError, match="supports model types"):
        ModelRunner(mm, num_blocks=4)


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_runner_equals_transformers(tmp_path):
    from molora.model.base import load_default_base

    model, _ = load_default_base()
    mm = molora.attach(model)
    runner = ModelRunner(mm, num_blocks=16, block_size=16, max_model_len=128)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 49152, (21,), generator=g), torch.randint(0, 49152, (6,), generator=g)
    meta = BatchMeta([21, 6], [21, 6], [[0, 1], [2]])
    logits = runner(torch.cat([a, b]), torch.cat([torch.arange(21), torch.arange(6)]), meta, logits=True).logits
    with torch.no_grad():
        for i, s in enumerate((a, b)):
            ref = mm.model(input_ids=s[None]).logits[0, -1]
            # 30 fp32 layers, logits up to ~20: summation order alone moves them by up to ~1e-4
            assert (logits[i] - ref).abs().max() <= 2 * TOL
        nxt = logits.argmax(-1)
        meta = BatchMeta([1, 1], [22, 7], [[0, 1], [2]])
        step = runner(nxt, torch.tensor([21, 6]), meta, logits=True).logits
        ref = mm.model(input_ids=torch.cat([a, nxt[:1]])[None]).logits[0, -1]
        assert (step[0] - ref).abs().max() <= 2 * TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_linear_follows_swapped_weights_and_rewritten_scales(mm, dtype):
    """The views a routed linear keeps between calls (weight.t(), B, a float32 copy of a bf16 scale) follow a
    weight whose data is swapped (as model.to() does) and a scale rewritten in place (an adapter load)."""
    mm.to(dtype)
    lin = next(m for m in mm.model.modules() if hasattr(m, "lora") and m.lora.active)
    slot = int(lin.lora.scale.float().argmax())  # a slot whose adapter targets lin
    x = torch.randn(5, lin.in_features, generator=gen(0)).to(dtype)
    with torch.no_grad():
        mm.context.set(torch.full((5, 1), slot, dtype=torch.long))
        try:
            lin(x)
            lin.weight.data = lin.weight.data * 2  # new storage, same Parameter
            y = lin(x).float()
            lin.lora.scale.mul_(2)  # in place: same tensor, new version
            y2 = lin(x).float()
        finally:
            mm.context.clear()
        base = torch.nn.functional.linear(x, lin.weight).float()
    delta, delta2 = y - base, y2 - base
    tol = 1e-5 if dtype == torch.float32 else 0.05 * delta.abs().max()
    assert delta.abs().max() > 10 * tol and (delta2 - 2 * delta).abs().max() <= 2 * tol


def test_vocab_router_lookup_equals_the_range_rule():
    """VocabRouter's bucket lookup gives the adapter of each id's range, the default between and outside them."""
    from molora.routing import VocabRouter

    r = VocabRouter([(5, 10, "b"), (10, 20, "a"), (30, 40, "c")], default="a")
    ids = torch.tensor([[-1, 0, 4, 5, 9, 10, 19, 20, 29, 30, 39, 40, 99]])
    want = [0, 0, 0, 1, 1, 0, 0, 0, 0, 2, 2, 0, 0]  # names a, b, c -> 0, 1, 2
    assert r.route(ids, ["a", "b", "c"]).adapter_ids.tolist() == [want]
    assert r.route(ids, ["c", "b", "a"]).adapter_ids.tolist() == [[{0: 2, 1: 1, 2: 0}[i] for i in want]]
    with pytest.raises(molora.RoutingError):
        r.route(ids, ["a", "b"])


@pytest.mark.skipif(
    not __import__("molora.ops.packed", fromlist=["available"]).available(),
    reason="MKL's packed linear is not in this torch build",
)
def test_packed_weights_give_the_logits_of_the_modules_gemms(mm):
    """The runner's base GEMMs on packed weights (the float32 CPU default) give the modules' own logits up to
    float32 rounding: ragged prefill, decode of several sequences and of one, with per-token routing."""
    runners = [ModelRunner(mm, num_blocks=32, block_size=4, max_model_len=64, pack_weights=p) for p in (False, True)]
    assert [r.pack_weights for r in runners] == [False, True]
    from molora.engine import Engine, EngineConfig

    assert Engine(mm, EngineConfig(max_model_len=64, kv_budget_tokens=128)).runner.pack_weights  # the default
    assert not Engine(mm, EngineConfig(max_model_len=64, kv_budget_tokens=128, pack_weights=False)).runner.pack_weights
    lens = [5, 9, 3]
    pager = _Pager(4)
    tables = [pager.table(i, n + 3) for i, n in enumerate(lens)]
    seqs = [_seq(n, 20 + i) for i, n in enumerate(lens)]
    routing = StepRouting(torch.cat([_slots(mm, _route(n, 30 + i)) for i, n in enumerate(lens)]))
    outs = [
        r(
            torch.cat(seqs),
            torch.cat([torch.arange(n) for n in lens]),
            BatchMeta(lens, lens, tables),
            routing,
            logits=True,
        ).logits
        for r in runners
    ]
    assert (outs[0] - outs[1]).abs().max() <= TOL
    for step, batch in enumerate(([0, 1, 2], [2])):  # three sequences, then one
        ctx = [lens[b] + 1 + step for b in batch]
        meta = BatchMeta([1] * len(batch), ctx, [tables[b] for b in batch])
        tok, pos = torch.tensor([7 + b for b in batch]), torch.tensor([c - 1 for c in ctx])
        slots = StepRouting(torch.tensor([[b % 2] for b in batch]))
        outs = [r(tok, pos, meta, slots, logits=True).logits for r in runners]
        assert (outs[0] - outs[1]).abs().max() <= TOL


def _one_call_model(tmp_path, kind: str):
    """(attached model, adapter names) for the one-call decode block tests: the tiny Llama with two adapters
    (every linear routed), with adapter "a" alone (k, o, gate and up carry no adapter: no delta there), the tiny
    Llama with both adapters over a weight-only int8 base ("llama_int8"), or a Qwen2 with q/k/v biases and
    adapter-free."""
    from transformers import Qwen2Config

    if kind == "qwen2_bias":
        cfg = Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        return molora.attach(random_model(cfg, seed=0)), []
    names = ["a", "b"] if kind in ("llama", "llama_int8") else ["a"]
    paths = {n: make_peft_adapter(tmp_path / n, "llama", seed=i, **SPECS[n]) for i, n in enumerate(names)}
    quantization = "int8" if kind == "llama_int8" else None
    return molora.attach(tiny_model("llama"), paths, quantization=quantization), names


def _decode_steps(runner, mm, names, lens, tables, steps=([0, 1, 2], [0, 1, 2], [2, 0], [1]), mix=False):
    """Logits of a ragged prefill, then of decode steps of the given sequences, with per-token routing over
    `names` and the base model (None where there are no adapters); mix: top-2 weighted rows instead (a static mix of
    both adapters, one adapter scaled, the base), as a step of mixed requests gives them."""
    slots = [mm.bank.slot_of(n) for n in names] + [-1]
    mixes = [([slots[0], slots[-2]], [0.7, -0.3]), ([slots[-2], -1], [0.5, 0.0]), ([-1, -1], [0.0, 0.0])] if mix else []

    def routing(rows: list[int]) -> StepRouting | None:
        if mix:
            picked = [mixes[r % len(mixes)] for r in rows]
            return StepRouting(torch.tensor([p[0] for p in picked]), torch.tensor([p[1] for p in picked]))
        return StepRouting(torch.tensor([[slots[r % len(slots)]] for r in rows])) if names else None

    seqs = [_seq(n, 20 + i) for i, n in enumerate(lens)]
    got = [
        runner(
            torch.cat(seqs),
            torch.cat([torch.arange(n) for n in lens]),
            BatchMeta(lens, lens, tables),
            routing(list(range(sum(lens)))),
            logits=True,
        ).logits
    ]
    for step, batch in enumerate(steps):
        ctx = [lens[b] + 1 + step for b in batch]
        meta = BatchMeta([1] * len(batch), ctx, [tables[b] for b in batch])
        tok = got[-1].argmax(-1)[: len(batch)] if step else torch.tensor([7, 8, 9])
        got.append(
            runner(
                tok, torch.tensor([c - 1 for c in ctx]), meta, routing([step + b for b in batch]), logits=True
            ).logits
        )
    return got


def _one_call_off(monkeypatch, runner) -> None:
    """This runner's blocks run kernel by kernel (the path the one-call block must equal)."""
    monkeypatch.setattr(runner, "_one_call", lambda *a: None)


@pytest.mark.parametrize("kind", ["llama", "llama_some_linears", "qwen2_bias", "llama_int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_block_in_one_call_equals_the_kernel_by_kernel_path(tmp_path, monkeypatch, kind, dtype):
    """A decode step's block as one C++ call (fused_cpu.run_block on its bound arguments) gives the logits of the
    same kernels called one by one from Python, bit for bit, over several decode steps with per-token routing;
    prefill steps and the single-sequence step keep the kernel-by-kernel path. Over a weight-only int8 base the
    block runs the int8 kernels (linear_w8 in float32, linear_amx_w8 in bfloat16) in both paths."""
    from molora.ops import fused_cpu, packed

    if not fused_cpu.available() or (dtype == torch.bfloat16 and not fused_cpu.amx()):
        pytest.skip("molora's C++ kernels (and, for bfloat16, the AMX tiles) are needed")
    mm, names = _one_call_model(tmp_path, kind)
    mm.to(dtype)
    runners = [ModelRunner(mm, num_blocks=32, block_size=4, max_model_len=64, pack_weights=True) for _ in range(2)]
    assert all(len(b.linears) == 7 for b in runners[0].blocks)
    if kind == "llama_int8":
        w = runners[0].blocks[0].linears[6].kernel_args(dtype)[0]
        assert w.dtype == torch.int8 and w.dim() == (2 if dtype == torch.float32 else 4)
    else:
        down = mm.model.model.layers[0].mlp.down_proj.weight
        assert packed.form(down) == ("panels" if dtype == torch.float32 else "amx")
    calls = []
    real = fused_cpu.run_block
    monkeypatch.setattr(fused_cpu, "run_block", lambda *a: calls.append(1) or real(*a))
    _one_call_off(monkeypatch, runners[1])
    lens = [5, 9, 3]
    pager = _Pager(4)
    tables = [pager.table(i, n + 4) for i, n in enumerate(lens)]
    one, each = (_decode_steps(r, mm, names, lens, tables) for r in runners)
    assert len(calls) == 3 * len(runners[0].blocks)  # the three steps of several sequences, every block
    for a, b in zip(one, each):
        assert a.dtype == dtype and torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top2_weighted_decode_steps_in_one_call_equal_the_kernel_by_kernel_path(tmp_path, monkeypatch, dtype):
    """Static mixes and scaled pins (top-2 rows with weights, padding choices -1): the one-call block runs one LoRA
    kernel call per choice column, in the order the per-linear path adds them, so the logits are equal bit for bit."""
    from molora.ops import fused_cpu

    if not fused_cpu.available() or (dtype == torch.bfloat16 and not fused_cpu.amx()):
        pytest.skip("molora's C++ kernels (and, for bfloat16, the AMX tiles) are needed")
    mm, names = _one_call_model(tmp_path, "llama")
    mm.to(dtype)
    runners = [ModelRunner(mm, num_blocks=32, block_size=4, max_model_len=64, pack_weights=True) for _ in range(2)]
    calls = []
    real = fused_cpu.run_block
    monkeypatch.setattr(fused_cpu, "run_block", lambda *a: calls.append(len(a[3][2]) if a[3] else 0) or real(*a))
    _one_call_off(monkeypatch, runners[1])
    lens = [5, 9, 3]
    pager = _Pager(4)
    tables = [pager.table(i, n + 4) for i, n in enumerate(lens)]
    one, each = (_decode_steps(r, mm, names, lens, tables, mix=True) for r in runners)
    S = mm.bank.num_slots
    # S counts per routed choice column: both columns routed in some steps, only the first in others
    assert len(calls) == 3 * len(runners[0].blocks) and 2 * S in calls and set(calls) <= {S, 2 * S}
    for a, b in zip(one, each):
        assert torch.equal(a, b)


def test_one_call_decode_steps_with_an_in_network_router_equal_the_kernel_by_kernel_path(tmp_path, monkeypatch):
    """With a router that decides per block (its decisions change the routing between blocks), one-call decode
    steps ask the routing's kernel arguments per block and give the kernel-by-kernel path's logits bit for bit."""
    from molora.ops import fused_cpu

    if not fused_cpu.available():
        pytest.skip("molora's C++ kernels are needed")
    mm, names = _one_call_model(tmp_path, "llama")
    runners = [ModelRunner(mm, num_blocks=32, block_size=4, max_model_len=64, pack_weights=True) for _ in range(2)]
    _one_call_off(monkeypatch, runners[1])
    calls = []
    real = fused_cpu.run_block
    monkeypatch.setattr(fused_cpu, "run_block", lambda *a: calls.append(1) or real(*a))
    slots = torch.tensor([mm.bank.slot_of(n) for n in BlockRouter.adapter_names])
    lens = [5, 9, 3]
    pager = _Pager(4)
    tables = [pager.table(i, n + 4) for i, n in enumerate(lens)]
    outs = []
    for runner in runners:
        router = BlockRouter()

        def routing(T: int) -> StepRouting:
            return StepRouting(
                torch.full((T, 1), -1), router=router, router_slots=slots, groups=[RouterGroup(torch.arange(T), None)]
            )

        seqs = [_seq(n, 20 + i) for i, n in enumerate(lens)]
        got = [
            runner(
                torch.cat(seqs),
                torch.cat([torch.arange(n) for n in lens]),
                BatchMeta(lens, lens, tables),
                routing(sum(lens)),
                logits=True,
            ).logits
        ]
        for step in range(3):
            ctx = [n + 1 + step for n in lens]
            tok = got[-1].argmax(-1)
            got.append(
                runner(
                    tok, torch.tensor([c - 1 for c in ctx]), BatchMeta([1, 1, 1], ctx, tables), routing(3), logits=True
                ).logits
            )
        outs.append(got)
    assert len(calls) == 3 * len(runners[0].blocks)
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bound_decode_blocks_follow_adapter_loads_scales_and_weights(tmp_path, monkeypatch, dtype):
    """The arguments a block binds once follow what changes under them: an adapter unloaded and loaded again
    (which linears carry a delta), a scale rewritten in place, a base weight swapped (its packed copy) and a norm
    written in place; each time the one-call runner equals the kernel-by-kernel one bit for bit."""
    from molora.ops import fused_cpu

    if not fused_cpu.available() or (dtype == torch.bfloat16 and not fused_cpu.amx()):
        pytest.skip("molora's C++ kernels (and, for bfloat16, the AMX tiles) are needed")
    mm, names = _one_call_model(tmp_path, "llama")
    mm.to(dtype)
    runners = [ModelRunner(mm, num_blocks=64, block_size=4, max_model_len=64, pack_weights=True) for _ in range(2)]
    _one_call_off(monkeypatch, runners[1])
    lens = [5, 9, 3]
    pager = _Pager(4)
    layer = mm.model.model.layers[1]

    def check() -> None:
        tables = [pager.table(len(pager.tables), n + 4) for n in lens]  # fresh cache blocks for each check
        for a, b in zip(*(_decode_steps(r, mm, [n for n in names if n in mm.bank], lens, tables) for r in runners)):
            assert torch.equal(a, b)

    check()
    mm.unload_adapter("b")  # k, o, gate, up lose their only adapter: no delta there
    check()
    mm.load_adapter("b", tmp_path / "b")
    check()
    with torch.no_grad():
        layer.self_attn.q_proj.lora.scale.mul_(3)  # in place
        layer.mlp.down_proj.weight.data = layer.mlp.down_proj.weight.data * 0.5  # new storage
        layer.input_layernorm.weight.mul_(1.5)
    check()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_slot_written_between_decode_steps_is_read_by_the_next_one_call_step(tmp_path, monkeypatch, dtype):
    """What the hot set does under traffic, between two decode steps of the same sequences: an adapter loaded into a
    free slot, another unloaded and a third loaded into the slot it left. The next one-call decode steps compute
    with the new slot contents, equal bit for bit to the kernel-by-kernel path (which reads the bank afresh); in
    float32, where the bound blocks read the slot tensors in place, no block is bound again (a bfloat16 bank's scales
    reach the kernel as a float32 copy, so its blocks bind again)."""
    from molora.model.block import Block
    from molora.ops import fused_cpu

    if not fused_cpu.available() or (dtype == torch.bfloat16 and not fused_cpu.amx()):
        pytest.skip("molora's C++ kernels (and, for bfloat16, the AMX tiles) are needed")
    mm, _ = _one_call_model(tmp_path, "llama")  # a in slot 0, b in slot 1 (of 4)
    extra = {"c": dict(SPECS["b"], seed=7), "d": dict(SPECS["a"], seed=8)}  # no linear gains or loses its last adapter
    paths = {n: make_peft_adapter(tmp_path / n, "llama", **spec) for n, spec in extra.items()}
    mm.to(dtype)
    runners = [ModelRunner(mm, num_blocks=32, block_size=4, max_model_len=64, pack_weights=True) for _ in range(2)]
    _one_call_off(monkeypatch, runners[1])
    binds: list[int] = []
    bind = Block._bind
    monkeypatch.setattr(Block, "_bind", lambda self, *a: binds.append(self.index) or bind(self, *a))
    lens = [5, 9, 3]
    pager = _Pager(4)
    tables = [pager.table(i, n + 4) for i, n in enumerate(lens)]
    seqs = [_seq(n, 30 + i) for i, n in enumerate(lens)]

    def both(tokens: torch.Tensor, positions: torch.Tensor, meta: BatchMeta, slots: list[int]) -> torch.Tensor:
        routing = StepRouting(torch.tensor(slots).repeat_interleave(torch.tensor(meta.query_lens))[:, None])
        a, b = (r(tokens, positions, meta, routing, logits=True).logits for r in runners)
        assert a.dtype == dtype and torch.equal(a, b)
        return a

    positions = torch.cat([torch.arange(n) for n in lens])
    logits = both(torch.cat(seqs), positions, BatchMeta(lens, lens, tables), [0, 1, -1])  # the prompts

    def decode(step: int, slots: list[int]) -> torch.Tensor:
        ctx = [n + 1 + step for n in lens]
        return both(logits.argmax(-1), torch.tensor([c - 1 for c in ctx]), BatchMeta([1, 1, 1], ctx, tables), slots)

    logits = decode(0, [0, 1, 1])  # binds every block
    assert len(binds) == len(runners[0].blocks)
    before = mm.bank.slots["model.layers.0.self_attn.q_proj"].A[1].clone()
    assert mm.load_adapter("c", paths["c"]) == 2
    mm.unload_adapter("b")
    assert mm.load_adapter("d", paths["d"]) == 1  # b's slot, other weights
    assert not torch.equal(mm.bank.slots["model.layers.0.self_attn.q_proj"].A[1], before)
    binds.clear()
    logits = decode(1, [1, 2, 0])
    logits = decode(2, [2, 1, 1])
    assert binds == ([] if dtype == torch.float32 else [b.index for b in runners[0].blocks])


@torch.no_grad()
def test_decode_block_keeps_the_kernel_by_kernel_path_where_a_piece_is_not_its_own(tmp_path):
    """Qwen3's q/k norms and weights left unpacked leave no block to bind; a prefill step, a per-linear router
    and an explicit non-fused dispatch backend leave the step kernel by kernel."""
    from molora.ops import fused_cpu

    if not fused_cpu.available():
        pytest.skip("molora's C++ kernels are needed")
    qwen3 = ModelRunner(
        molora.attach(tiny_model("qwen3")), num_blocks=8, block_size=4, max_model_len=32, pack_weights=True
    )
    assert all(b.linears == () for b in qwen3.blocks)
    mm, names = _one_call_model(tmp_path, "llama")
    unpacked = ModelRunner(mm, num_blocks=8, block_size=4, max_model_len=32, pack_weights=False)
    assert all(b.linears == () for b in unpacked.blocks)
    runner = ModelRunner(mm, num_blocks=8, block_size=4, max_model_len=32, pack_weights=True)
    pos = torch.tensor([2, 1])
    plan = runner.plan(pos, BatchMeta([1, 1], [3, 2], [[0], [1]]))
    h = torch.zeros(2, 64)
    assert runner._one_call(h, plan, False) == ()  # no routing: no deltas
    mm.context.set(torch.tensor([[0], [1]]))
    try:
        assert isinstance(runner._one_call(h, plan, False), tuple) and runner._one_call(h, plan, False)
        mm.context.linear = object()  # a per-linear router's decisions (molora.routing.arrow)
        assert runner._one_call(h, plan, False) is None
        mm.context.linear = None
        mm.dispatcher.backend = "sort_group"
        assert runner._one_call(h, plan, False) is None
    finally:
        mm.dispatcher.backend = "auto"
        mm.context.clear()
    prefill = runner.plan(torch.tensor([0, 1, 0]), BatchMeta([2, 1], [2, 1], [[0], [1]]))
    assert runner._one_call(torch.zeros(3, 64), prefill, False) is None
