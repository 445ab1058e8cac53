"""Speculative decoding (molora.engine.speculative): vLLM's config is read and checked; drafts come from the request's
own tokens; greedy output with speculation equals output without it, token for token and adapter for adapter, under
every routing mode (pinned, token-id router, base, learned router with and without carry, Arrow), in a busy chunked
batch that preempts, and with stop ids, stop strings, max_tokens and abort; rejected rows roll back (KV blocks,
pools)."""

from __future__ import annotations

import pytest
import torch

import molora
from molora.config import LLAMA_PROJECTIONS, SamplingParams
from molora.engine import Engine, EngineConfig
from molora.engine.speculative import (
    SpeculativeConfig,
    carry_valid,
    greedy_accept,
    ngram_draft,
    suffix_draft,
)
from molora.errors import MoLoRAError
from molora.routing import ArrowConfig, ArrowRouter, VocabRouter
from tests.conftest import make_peft_adapter, tiny_model
from tests.test_engine import SPECS, ByteTokenizer, _prompt
from tests.test_multimodal import BOI, tiny_bundle  # noqa: F401  (a fixture)

ARCH = "qwen3"
CFG = dict(
    max_num_seqs=8, max_tokens_per_step=48, block_size=4, kv_budget_tokens=1024, max_model_len=128, stop_at_eos=False
)
NGRAM = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3)
RERUN = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, carry="rerun")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {n: make_peft_adapter(root / n, ARCH, seed=i, **s) for i, (n, s) in enumerate(SPECS.items())}


def _mm(paths, router: str = "vocab"):
    mm = molora.attach(
        tiny_model(ARCH),
        paths,
        router=VocabRouter([(0, 50, "a"), (50, 90, "b")], default="c"),
        target_modules=LLAMA_PROJECTIONS,
    )
    if router in ("learned", "carry"):
        from molora.routing.learned import LearnedRouter, LearnedRouterConfig, decoder_layers

        cfg = LearnedRouterConfig(
            ("b", "a"), mm.config.hidden_size, len(decoder_layers(mm.model)), carry_blocks=int(router == "carry")
        )
        mm.router = LearnedRouter(cfg)
        with torch.no_grad():
            mm.router.weight.normal_(generator=torch.Generator().manual_seed(0))
    elif router == "arrow":
        mm.router = ArrowRouter(ArrowConfig(granularity="per_linear", top_k=2), ["a", "b", "c"]).bind(mm)
    return mm


# the requests of each routing mode: (add_request keywords) per prompt
MODES = {
    "pinned": dict(adapter="b"),
    "vocab": dict(routing="vocab"),
    "base": dict(routing="none"),
    "learned": {},
    "carry": {},
    "carry_rerun": {},  # the carrying router, draft rows after a wrong carry computed again (carry "rerun")
    "arrow": dict(routing="arrow"),
}
PROMPTS = [_prompt(9, 1) * 2, _prompt(5, 2) * 3, _prompt(13, 3), _prompt(7, 4) + _prompt(3, 5) * 4]


def _spec_engine(mm, spec=NGRAM, **kw) -> Engine:
    """An engine with speculation in every step, however many requests decode (the default turns it off above
    speculative.MAX_DECODES, a speed choice): these tests check exactness in batches too."""
    engine = Engine(mm, EngineConfig(**{**CFG, **kw.pop("cfg", {})}, speculative=spec), **kw)
    assert engine.speculator is not None
    engine.speculator.max_decodes = 1 << 30
    return engine


def _router_of(mode: str) -> str:
    if mode == "carry_rerun":
        return "carry"
    return mode if mode in ("learned", "carry", "arrow") else "vocab"


def _oracle(engine: Engine, ref: dict[tuple, list[int]], wrong_every: int = 5) -> None:
    """Make the engine's drafts the reference continuation (what plain decoding gives), with every wrong_every-th
    id replaced: long runs are accepted and every row position of a chunk gets rejected sometime."""
    spec = engine.speculator
    assert spec is not None

    def propose(req, room):
        g, cont = req.num_generated, ref[tuple(req.prompt_ids)]
        draft = cont[g : g + min(room, spec.config.num_speculative_tokens)]
        return [(t + 1) % 128 if (g + j) % wrong_every == 3 else t for j, t in enumerate(draft)]

    spec.propose = propose  # type: ignore[method-assign]


@torch.no_grad()
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_with_speculation_equals_without_in_tokens_and_adapters(paths, mode):
    """Every routing mode: prompt-lookup drafts and oracle drafts with wrong ids give exactly the tokens and the
    per-token adapters of plain decoding, and rejected rows leave the KV pool as it was."""
    sp = SamplingParams(max_new_tokens=24)
    kw = MODES[mode]
    plain = Engine(_mm(paths, _router_of(mode)), EngineConfig(**CFG)).generate(PROMPTS, sp, **kw)
    ref = {tuple(p): o.new_token_ids for p, o in zip(PROMPTS, plain)}
    for oracle in (False, True):
        engine = _spec_engine(_mm(paths, _router_of(mode)), RERUN if mode == "carry_rerun" else NGRAM)
        free = engine.allocator.num_free
        if oracle:
            _oracle(engine, ref)
        got = engine.generate(PROMPTS, sp, **kw)
        for p, g in zip(plain, got):
            assert g.new_token_ids == p.new_token_ids, (mode, oracle)
            assert g.token_adapters == p.token_adapters, (mode, oracle)
            assert g.finish_reason == p.finish_reason == "length"
        st = engine.stats()["speculative"]
        assert 0 < st["accepted"] < st["drafted"], st  # drafts were both kept and rejected
        assert engine.steps < sum(len(o.new_token_ids) for o in plain)  # fewer steps than one id per step
        engine.check()
        assert engine.allocator.num_free == free and not engine.requests
        if mode == "carry" and oracle:
            assert st["carry_cut_rows"] > 0  # some draft rows assumed a carried decision the forward did not give
            assert st["carry_reruns"] == 0
        if mode == "carry_rerun" and oracle:  # those rows were computed again instead, none dropped for it
            assert st["carry_reruns"] > 0 and st["carry_rerun_rows"] >= st["carry_reruns"]
            assert st["carry_cut_rows"] == 0
    if mode in ("vocab", "learned", "carry", "carry_rerun"):  # the comparison of adapters can tell a wrong one
        assert any(len(set(o.token_adapters)) > 1 for o in plain)


@torch.no_grad()
def test_suffix_drafts_with_recent_outputs_keep_greedy_output(paths):
    """The "suffix" method, drawing also on the outputs of earlier requests on the same adapter: the same tokens
    and adapters as plain decoding, and some of its drafts accepted."""
    sp = SamplingParams(max_new_tokens=24)
    spec = SpeculativeConfig(method="suffix", num_speculative_tokens=3, suffix_decoding_max_cached_requests=4)
    plain = Engine(_mm(paths), EngineConfig(**CFG)).generate(PROMPTS, sp, adapter="a")
    engine = _spec_engine(_mm(paths), spec)
    for _ in range(2):  # the second round finds the first round's outputs among the recent ones
        got = engine.generate(PROMPTS, sp, adapter="a")
        assert [g.new_token_ids for g in got] == [p.new_token_ids for p in plain]
        assert [g.token_adapters for g in got] == [p.token_adapters for p in plain]
    assert len(engine.speculator.recent["a"]) == 4
    assert engine.stats()["speculative"]["accepted"] > 0


@pytest.mark.slow
@torch.no_grad()
def test_busy_chunked_preempting_batch_with_speculation_equals_plain(paths):
    """A small step budget (chunked prefill beside verified drafts) and a KV pool small enough to preempt: every
    request's tokens and adapters equal those of plain decoding, and the pools end as they began."""
    busy = dict(CFG, max_tokens_per_step=16, num_kv_blocks=40)
    prompts = [_prompt(20 + i, 10 + i) + _prompt(4, 40 + i) * 3 for i in range(6)]
    routing = [dict(adapter="a"), {}, dict(adapter="c"), dict(routing="none"), {}, {}]
    sp = SamplingParams(max_new_tokens=24)

    def run(spec):
        engine = Engine(_mm(paths, "carry"), EngineConfig(**busy, speculative=spec))
        if engine.speculator is not None:
            engine.speculator.max_decodes = 1 << 30
        ids = [engine.add_request(p, sp, **kw) for p, kw in zip(prompts, routing)]
        got = {i: ([], []) for i in ids}
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id][0].extend(out.new_token_ids)
                got[out.request_id][1].extend(out.token_adapters)
            engine.check()
        assert engine.allocator.num_free == 40
        return [got[i] for i in ids], engine.stats()

    plain, _ = run(None)
    for config in (NGRAM, RERUN):  # both carry treatments
        spec, stats = run(config)
        assert spec == plain, config.carry
        assert stats["num_preemptions"] > 0 and stats["speculative"]["accepted"] > 0


@torch.no_grad()
def test_stop_ids_stop_strings_max_tokens_and_abort_act_as_without_speculation(paths):
    """A stop id or stop string inside an accepted run ends the request at the same token with the same text; a
    draft never runs past max_new_tokens; an abort mid-flight frees everything."""
    mm_args = (paths,)
    prompt = PROMPTS[3]
    sp = SamplingParams(max_new_tokens=30)
    ref = Engine(_mm(*mm_args), EngineConfig(**CFG), tokenizer=ByteTokenizer()).generate([prompt], sp)[0]
    stop_id = ref.new_token_ids[12]
    stop_text = ref.new_text[15:17]
    cases = [
        SamplingParams(max_new_tokens=30, stop_token_ids=(stop_id,)),
        SamplingParams(max_new_tokens=30, stop=(stop_text,)),
        SamplingParams(max_new_tokens=7),
        SamplingParams(max_new_tokens=30, logprobs=2),
    ]
    for params in cases:
        outs = []
        for spec in (None, NGRAM):
            engine = Engine(_mm(*mm_args), EngineConfig(**CFG, speculative=spec), tokenizer=ByteTokenizer())
            outs.append(engine.generate([prompt], params)[0])
            engine.check()
        plain, fast = outs
        assert fast.new_token_ids == plain.new_token_ids and fast.new_text == plain.new_text
        assert fast.finish_reason == plain.finish_reason and fast.token_adapters == plain.token_adapters
        if params.logprobs:
            assert [e["token_id"] for e in fast.logprobs] == fast.new_token_ids
            for a, b in zip(fast.logprobs, plain.logprobs):
                assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
    assert len(outs[0].new_token_ids) == 30
    engine = Engine(_mm(*mm_args), EngineConfig(**CFG, speculative=NGRAM))
    free = engine.allocator.num_free
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=60))
    for _ in range(6):
        engine.step()
    engine.abort(rid)
    outs = engine.step()
    assert [o.finish_reason for o in outs] == ["abort"]
    engine.check()
    assert engine.allocator.num_free == free and not engine.hotset.pins and not engine.requests


@torch.no_grad()
def test_speculation_runs_alone_and_stays_off_while_more_requests_decode(paths):
    """By default drafts are made only while at most MAX_DECODES requests decode (the measured turning point): one
    request alone speculates, four together do not, and both give plain decoding's tokens."""
    from molora.engine.speculative import MAX_DECODES

    assert MAX_DECODES == 1
    sp = SamplingParams(max_new_tokens=16)
    plain = Engine(_mm(paths), EngineConfig(**CFG)).generate(PROMPTS, sp, adapter="a")
    alone = Engine(_mm(paths), EngineConfig(**CFG, speculative=NGRAM))
    assert alone.generate([PROMPTS[1]], sp, adapter="a")[0].new_token_ids == plain[1].new_token_ids
    assert alone.stats()["speculative"]["drafted"] > 0
    busy = Engine(_mm(paths), EngineConfig(**CFG, speculative=NGRAM))
    assert [o.new_token_ids for o in busy.generate(PROMPTS, sp, adapter="a")] == [o.new_token_ids for o in plain]
    assert busy.stats()["speculative"]["drafted"] == 0


def test_config_reads_vllm_json_and_refuses_unknown_methods_and_keys():
    c = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    )
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == ("ngram", 5, 4, 2)
    s = SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": 3, "suffix_decoding_max_tree_depth": 8})
    assert s.method == "suffix" and s.suffix_decoding_max_tree_depth == 8
    assert s.carry == "truncate"  # the default
    r = SpeculativeConfig.parse('{"method": "ngram", "molora": {"carry": "rerun"}}')
    assert (r.method, r.carry) == ("ngram", "rerun")
    bad = [
        ("{not json", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"method": "eagle"}', "method='eagle'"),
        ('{"method": "ngram", "model": "x"}', r"\['model'\]"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens=0"),
        ('{"prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min=5"),
        ('{"method": "suffix", "prompt_lookup_max": 2}', r"\['prompt_lookup_max'\]"),
        ('{"molora": {"carry": "redo"}}', r"\"carry\": 'redo'.*truncate, rerun"),
        ('{"molora": {"carry": "rerun", "depth": 2}}', r"\"molora\" key\(s\) \['depth'\]"),
        ('{"molora": "rerun"}', r"\"molora\" must be a JSON object"),
    ]
    for text, match in bad:
        with pytest.raises(MoLoRAError, match=match):
            SpeculativeConfig.parse(text)
    with pytest.raises(MoLoRAError, match="EngineConfig.speculative"):
        EngineConfig(speculative={"method": "ngram"})  # type: ignore[arg-type]


def test_drafts_follow_the_longest_recurring_suffix():
    toks = [1, 2, 3, 4, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert ngram_draft(toks, 2, 3, 1) == [7, 8]  # the latest earlier [1, 2, 3] is followed by 7 8
    assert ngram_draft(toks, 5, 4, 4) == []  # [5, 1, 2, 3] never occurred before
    assert ngram_draft([4, 5, 6], 3, 2, 1) == []
    assert ngram_draft([5, 5, 5], 4, 2, 1) == [5]  # a run: what followed [5, 5] at the start
    # suffix: the most frequent continuation of the longest match, also over other outputs
    assert suffix_draft(toks, 2, 8) == [7, 8]
    assert suffix_draft([1, 2, 3], 3, 8, corpus=[[0, 1, 2, 3, 6, 6], [2, 3, 6, 1], [2, 3, 4]]) == [6, 6]
    assert suffix_draft([9, 8], 3, 8, corpus=[[1, 2]]) == []


def test_greedy_acceptance_and_carry_validity():
    logits = torch.full((4, 10), -1.0)
    for row, best in enumerate([3, 5, 7, 2]):
        logits[row, best] = 1.0
    assert greedy_accept(logits, [3, 5, 7]) == [3, 5, 7, 2]  # all kept, one more
    assert greedy_accept(logits, [3, 6, 7]) == [3, 5]  # the first mismatch is replaced
    assert greedy_accept(logits, [0, 5, 7]) == [3]
    assert greedy_accept(logits[:1], []) == [3]
    assert carry_valid([0, 1, 1, 1], [1, 1, 0, 1]) == 3  # row 3 assumed 1, row 2 gave 0
    assert carry_valid([0, 1, 1], [0, 1, 1]) == 1


# ------------------------------------------------------------------------------------------ sampling


def _chi2_bound(df: int, z: float = 3.29) -> float:
    """The chi-square quantile of `df` degrees of freedom at about 1 - 5e-4 (z: the normal quantile), by
    Wilson-Hilferty's cube-root approximation (within 1% there for df >= 2)."""
    a = 2 / (9 * df)
    return df * (1 - a + z * a**0.5) ** 3


def _chi2(observed: list[int], expected: list[float]) -> float:
    return sum((o - e) ** 2 / e for o, e in zip(observed, expected))


def test_rejection_sampling_keeps_each_emitted_id_distributed_as_plain_sampling():
    """20,000 seeded draws with a two-id draft: the first emitted id follows row 0's distribution, the next follows
    row 1's given that the first was the draft, the one after a whole accepted draft row 2's; a chi-square bound at
    about 1 - 5e-4 holds for each, and the same bound rejects a wrong rule (on a rejection drawing from p without
    removing the draft id)."""
    from molora.engine.speculative import rejection_accept

    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.6, 0.1], [0.25, 0.25, 0.4, 0.1]])
    draft = [1, 2]
    g = torch.Generator().manual_seed(7)
    N = 20000
    runs = [rejection_accept(p, draft, g) for _ in range(N)]

    def counts(seqs: list[list[int]], at: int) -> list[int]:
        return [sum(1 for s in seqs if s[at] == v) for v in range(4)]

    first = counts(runs, 0)
    assert _chi2(first, [N * x for x in p[0].tolist()]) < _chi2_bound(3)
    after1 = [r for r in runs if r[0] == 1]
    assert _chi2(counts(after1, 1), [len(after1) * x for x in p[1].tolist()]) < _chi2_bound(3)
    after2 = [r for r in runs if r[:2] == [1, 2]]
    assert all(len(r) == 3 for r in after2) and len(after2) > 1000
    assert _chi2(counts(after2, 2), [len(after2) * x for x in p[2].tolist()]) < _chi2_bound(3)

    def wrong(p: torch.Tensor, draft: list[int], g: torch.Generator) -> list[int]:  # the draft id stays in
        if float(torch.rand(1, generator=g)) < float(p[0, draft[0]]):
            return [draft[0]]
        return [int(torch.multinomial(p[0:1], 1, generator=g)[0, 0])]

    bad = counts([wrong(p, draft, g) for _ in range(N)], 0)
    assert _chi2(bad, [N * x for x in p[0].tolist()]) > _chi2_bound(3)


def test_rejection_sampling_verifies_on_row_by_row_as_in_one_call():
    """Without a row after the draft no id is added, and verifying a draft in two calls (the first draft id alone
    against row 0, the rest against the rows after it, as carry "rerun" does) draws exactly what one call draws
    from the same generator."""
    from molora.engine.speculative import rejection_accept

    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.6, 0.1], [0.25, 0.25, 0.4, 0.1]])
    assert rejection_accept(torch.eye(4)[:2], [0, 1], None) == [0, 1]  # certain draft, no row after it: no more
    split_seen = set()
    for seed in range(200):
        one = rejection_accept(p, [1, 2], torch.Generator().manual_seed(seed))
        g = torch.Generator().manual_seed(seed)
        split = rejection_accept(p[:1], [1], g)
        if split == [1]:
            split += rejection_accept(p[1:], [2], g)
        assert split == one
        split_seen.add(len(one))
    assert split_seen == {1, 2, 3}  # rejected at row 0, at row 1, and the whole draft accepted


@pytest.mark.slow
@torch.no_grad()
def test_sampled_output_with_speculation_is_distributed_as_without(paths):
    """Temperature and top_k on the tiny model, 800 seeded requests each way, drafts the greedy continuation (often
    the most likely id, so drafts are accepted and rejected): the joint distribution of the first two ids with
    speculation equals that without it by a two-sample chi-square bound."""
    prompt = PROMPTS[0]
    cfg = dict(CFG, max_num_seqs=64, kv_budget_tokens=8192)
    greedy = Engine(_mm(paths), EngineConfig(**cfg)).generate([prompt], SamplingParams(max_new_tokens=4), adapter="b")
    ref = {tuple(prompt): greedy[0].new_token_ids}
    N = 800

    def draws(spec, seed0):
        engine = Engine(_mm(paths), EngineConfig(**cfg, speculative=spec))
        if engine.speculator is not None:
            engine.speculator.max_decodes = 1 << 30
        if spec is not None:
            _oracle(engine, ref, wrong_every=10**6)
        params = [SamplingParams(max_new_tokens=3, temperature=0.03, top_k=4, seed=seed0 + i) for i in range(N)]
        outs = engine.generate([prompt] * N, params, adapter="b")
        return [tuple(o.new_token_ids[:2]) for o in outs], engine.stats()

    plain, _ = draws(None, 0)
    fast, stats = draws(NGRAM, 100000)
    assert 0 < stats["speculative"]["accepted"] < stats["speculative"]["drafted"]
    cells = sorted(set(plain) | set(fast))
    a = [plain.count(c) for c in cells]
    b = [fast.count(c) for c in cells]
    big = [i for i in range(len(cells)) if a[i] + b[i] >= 10]
    a2 = [a[i] for i in big] + [sum(a) - sum(a[i] for i in big)]
    b2 = [b[i] for i in big] + [sum(b) - sum(b[i] for i in big)]
    stat = sum((x - y) ** 2 / (x + y) for x, y in zip(a2, b2) if x + y > 0)
    assert len(big) >= 3 and stat < _chi2_bound(len(a2) - 1)


# ------------------------------------------------------------------------------------------ command line


def test_serve_and_generate_refuse_a_bad_speculative_config_before_loading_anything(capsys):
    from molora.cli import main

    for argv, match in (
        (["serve", "--speculative-config", "{oops"], "not valid JSON"),
        (["serve", "--speculative-config", '{"method": "ngram", "draft_tensor_parallel_size": 1}'], "draft_tensor"),
        (["generate", "hi", "--speculative-config", '{"method": "medusa"}'], "method='medusa'"),
        (["generate", "hi", "--speculative-config", '{"num_speculative_tokens": -1}'], "num_speculative_tokens=-1"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert match in err and "error" in err, err


def test_generate_with_speculation_answers_as_the_engine_does_without(tiny_bundle, capsys):
    """`molora generate --speculative-config` answers through the engine: the same text as the engine without it."""
    from molora.bundle import load
    from molora.cli import main
    from molora.cli.generate import engine_answer

    prompt = f"draw the digit 3 {BOI}"
    plain = engine_answer(load(tiny_bundle), prompt, max_new_tokens=24)
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'
    assert (
        main(["generate", prompt, "--bundle", str(tiny_bundle), "--max-tokens", "24", "--speculative-config", spec])
        == 0
    )
    assert capsys.readouterr().out.strip() == plain and plain


@torch.no_grad()
@pytest.mark.parametrize("stream", [False, True])
def test_the_server_with_speculation_answers_as_without(paths, stream):
    """Over HTTP (/v1/completions, greedy, a repetitive prompt so that drafts are accepted): the same token ids,
    text and finish reason with --speculative-config as without, streamed (several ids may arrive in one chunk) or
    not."""
    import json

    from fastapi.testclient import TestClient

    from molora.server import create_app
    from tests.test_server import ToyTokenizer

    def answer(spec: SpeculativeConfig | None) -> tuple[list[int], str, str | None, Engine]:
        mm = molora.attach(
            tiny_model(ARCH),
            paths,
            router=VocabRouter([(0, 50, "a"), (50, 90, "b")], default="c"),
            target_modules=LLAMA_PROJECTIONS,
            tokenizer=ToyTokenizer(),
        )
        engine = Engine(mm, EngineConfig(**CFG, speculative=spec))
        body = {
            "model": "tiny",
            "prompt": PROMPTS[1],
            "max_tokens": 20,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
            "molora": {"return_routing": True},
        }
        with TestClient(create_app(engine, model_name="tiny")) as http:
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
        if not stream:
            choice = r.json()["choices"][0]
            return choice["molora"]["token_ids"], choice["text"], choice["finish_reason"], engine
        ids: list[int] = []
        text, finish = "", None
        for line in r.text.splitlines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[len("data: ") :])["choices"][0]
            ids += (choice.get("molora") or {}).get("token_ids", [])
            text += choice["text"]
            finish = choice["finish_reason"] or finish
        return ids, text, finish, engine

    plain_ids, plain_text, plain_finish, _ = answer(None)
    ids, text, finish, engine = answer(NGRAM)
    assert len(plain_ids) == 20 and plain_finish == "length"
    assert (ids, text, finish) == (plain_ids, plain_text, plain_finish)
    assert engine.stats()["speculative"]["accepted"] > 0  # the answer did come from verified drafts
