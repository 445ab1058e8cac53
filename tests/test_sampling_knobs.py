"""The logit knobs clients send (logit_bias, bad words, presence / frequency / repetition penalties, min_p) are
batched in the sampler and mean what OpenAI and vLLM mean: each row of a batch equals a plain per-row reference
written here, rows without knobs are left on the path they took before (same greedy tokens on a tiny model), and
the server accepts each knob and refuses bad values with a 400 naming the parameter."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from fastapi.testclient import TestClient

from molora.config import SamplingParams
from molora.engine import Engine
from molora.engine import sampler as engine_sampler
from molora.engine.request import Request
from molora.engine.sampler import sample_step
from molora.errors import MoLoRAError
from molora.sampling import adjust_logits_rows, filter_logits, filter_logits_rows
from molora.server import create_app
from tests.test_min_tokens import PROMPTS, routed_engine
from tests.test_server import FakeEngine, assert_error

V = 61
EOS = frozenset({2})


# ------------------------------------------------------------------------------------------ the reference


def reference_adjust(row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row's logits [V] with its knobs applied, token by token, as OpenAI and vLLM describe them."""
    x = [float(v) for v in row]
    for t, b in p.logit_bias.items():
        x[t] += b
    for word in p.bad_words_ids:
        head = list(word[:-1])
        if not head or output[len(output) - len(head) :] == head and len(output) >= len(head):
            x[word[-1]] = -math.inf
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(output).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return torch.tensor(x)


def reference_filter(scaled: torch.Tensor, min_p: float, top_k: int, top_p: float) -> torch.Tensor:
    """The ids [V] (bool) a sampled row keeps after temperature: min_p on probabilities (vLLM's form), then top-k,
    then the top-p nucleus, one id at a time."""
    probs = scaled.double().softmax(-1).tolist()
    keep = [q >= min_p * max(probs) for q in probs]
    order = sorted(range(len(probs)), key=lambda t: -scaled[t].item())
    if 0 < top_k < len(probs):
        kth = scaled[order[top_k - 1]].item()
        keep = [k and scaled[t].item() >= kth for t, k in enumerate(keep)]
    if top_p < 1.0:
        kept = [t for t in order if keep[t]]
        z = sum(math.exp(scaled[t].item()) for t in kept)
        mass = 0.0
        for t in kept:
            if mass >= top_p:
                keep[t] = False
            mass += math.exp(scaled[t].item()) / z
    return torch.tensor(keep)


def knobs(rng: random.Random) -> dict:
    """Random knob values, each on with some chance (all off sometimes)."""
    out: dict = {}
    if rng.random() < 0.4:
        out["logit_bias"] = {rng.randrange(V): rng.choice([-100.0, -3.5, 0.0, 2.0, 100.0]) for _ in range(3)}
    if rng.random() < 0.4:
        out["bad_words_ids"] = [(rng.randrange(V),), (5, 6), (rng.randrange(V), rng.randrange(V), 9)]
    if rng.random() < 0.4:
        out["presence_penalty"] = rng.choice([-2.0, -0.5, 0.7, 2.0])
    if rng.random() < 0.4:
        out["frequency_penalty"] = rng.choice([-1.0, 0.3, 2.0])
    if rng.random() < 0.4:
        out["repetition_penalty"] = rng.choice([0.5, 1.3, 2.0])
    return out


def request(rng: random.Random, name: str, **params) -> Request:
    p = SamplingParams(max_new_tokens=64, seed=rng.randrange(1000), **params)
    gen = None if p.greedy else torch.Generator().manual_seed(p.seed)
    req = Request(name, [rng.randrange(V) for _ in range(rng.randint(1, 6))], p, route=None, generator=gen)
    req.tokens += [rng.choice([5, 6, 7, rng.randrange(V)]) for _ in range(rng.randint(0, 12))]  # repeats
    return req


# ------------------------------------------------------------------------------------------ semantics


@pytest.mark.parametrize(
    "only",
    [
        "logit_bias",
        "bad_words_ids",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        None,  # all knobs, combined at random
    ],
)
def test_adjust_logits_rows_equals_the_per_row_reference(only):
    rng = random.Random(7)
    g = torch.Generator().manual_seed(7)
    for _ in range(25):
        b = rng.randint(1, 6)
        reqs = []
        for j in range(b):
            k = knobs(rng)
            reqs.append(request(rng, f"r{j}", **({only: k[only]} if only in k else {} if only else k)))
        logits = torch.randn(b, V, generator=g) * 3
        outputs = [r.tokens[len(r.prompt_ids) :] for r in reqs]
        ps = [r.params for r in reqs]
        got = adjust_logits_rows(
            logits,
            [p.logit_bias for p in ps],
            [p.bad_words_ids for p in ps],
            outputs,
            [r.prompt_ids for r in reqs],
            [p.presence_penalty for p in ps],
            [p.frequency_penalty for p in ps],
            [p.repetition_penalty for p in ps],
        )
        for j, r in enumerate(reqs):
            want = reference_adjust(logits[j], r.params, r.prompt_ids, outputs[j])
            assert torch.equal(torch.isinf(got[j]), torch.isinf(want)), (j, r.params)
            finite = torch.isfinite(want)
            assert torch.allclose(got[j][finite], want[finite], atol=1e-5), (j, r.params)
            if not r.params.adjusts_logits:
                assert torch.equal(got[j], logits[j])  # a row without knobs is copied as it was


def test_a_one_token_bad_word_is_always_banned_and_a_longer_one_only_after_its_head():
    words = [(3,), (10, 11, 12)]

    def banned(output: list[int]) -> set[int]:
        out = adjust_logits_rows(torch.zeros(1, V), [{}], [words], [output], [[1]], [0.0], [0.0], [1.0])
        return set(torch.isinf(out[0]).nonzero().flatten().tolist())

    assert banned([]) == {3}
    assert banned([10]) == {3}
    assert banned([10, 11]) == {3, 12}
    assert banned([4, 10, 11]) == {3, 12}
    assert banned([10, 11, 4]) == {3}


def test_min_p_keeps_what_the_reference_keeps_and_rows_equal_filter_logits():
    rng = random.Random(3)
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        b = rng.randint(1, 6)
        logits = torch.randn(b, V, generator=g) * 2
        temps = [rng.choice([0.5, 1.0, 1.7]) for _ in range(b)]
        min_ps = [rng.choice([0.0, 0.0, 0.05, 0.3, 0.9, 1.0]) for _ in range(b)]
        top_ks = [rng.choice([0, 0, 3, 20]) for _ in range(b)]
        top_ps = [rng.choice([1.0, 1.0, 0.8, 0.3]) for _ in range(b)]
        got = filter_logits_rows(logits, temps, top_ks, top_ps, min_ps)
        for j in range(b):
            assert torch.equal(
                got[j : j + 1], filter_logits(logits[j : j + 1], temps[j], top_ks[j], top_ps[j], min_ps[j])
            )
            want = reference_filter(logits[j] / temps[j], min_ps[j], top_ks[j], top_ps[j])
            assert torch.equal(torch.isfinite(got[j]), want), (temps[j], min_ps[j], top_ks[j], top_ps[j])


def test_sample_step_with_knobs_picks_what_each_row_picks_alone():
    """Rows with and without knobs in one batch, greedy and sampled: each picks what it picks alone (seeded rows
    draw the same), greedy rows pick the reference's argmax, and the logits passed in are left untouched."""
    rng = random.Random(11)
    g = torch.Generator().manual_seed(11)
    for _ in range(25):
        b = rng.randint(1, 8)
        reqs = []
        for j in range(b):
            extra = dict(temperature=rng.choice([0.0, 0.0, 0.8, 1.3]), min_p=rng.choice([0.0, 0.1]))
            extra["min_tokens"] = rng.choice([0, 0, 40])
            reqs.append(request(rng, f"r{j}", **knobs(rng), **extra))
        logits = torch.randn(b, V, generator=g) * 3
        before = logits.clone()
        chosen, dead = sample_step(reqs, logits, [True] * b, EOS)
        assert dead == {} and torch.equal(logits, before)
        for j, r in enumerate(reqs):
            alone = Request("a", r.prompt_ids, r.params, route=None, generator=None)
            alone.tokens = list(r.tokens)
            if not r.params.greedy:
                alone.generator = torch.Generator().manual_seed(r.params.seed)
            assert sample_step([alone], logits[j : j + 1], [True], EOS)[0].tolist() == [int(chosen[j])], j
            if r.params.greedy:
                want = reference_adjust(logits[j], r.params, r.prompt_ids, r.tokens[len(r.prompt_ids) :])
                if r.num_generated < r.params.min_tokens:
                    want[sorted(EOS)] = -math.inf
                assert int(chosen[j]) == int(want.argmax()), (j, r.params)


def test_a_step_without_knobs_takes_no_copy(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("adjust_logits_rows ran for a step whose rows use no knob")

    monkeypatch.setattr(engine_sampler, "adjust_logits_rows", refuse)
    rng = random.Random(5)
    reqs = [request(rng, f"r{j}", temperature=t, min_p=0.2) for j, t in enumerate([0.0, 1.0, 0.0])]
    assert not any(r.params.adjusts_logits for r in reqs)
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5))
    chosen, _ = sample_step(reqs, logits, [True] * 3, EOS)
    assert int(chosen[0]) == int(logits[0].argmax())


def test_sampling_params_validate_each_knob():
    for kw, msg in [
        ({"presence_penalty": 2.5}, "presence_penalty=2.5 must lie in"),
        ({"frequency_penalty": -3.0}, "frequency_penalty=-3.0 must lie in"),
        ({"frequency_penalty": math.nan}, "frequency_penalty=nan"),
        ({"repetition_penalty": 0.0}, "repetition_penalty=0.0 must lie in"),
        ({"repetition_penalty": 5.89e307}, r"repetition_penalty=5.89e\+307 must lie in"),
        ({"repetition_penalty": math.inf}, "repetition_penalty=inf"),
        ({"min_p": 1.5}, r"min_p=1.5 must lie in \[0, 1\]"),
        ({"logit_bias": {5: 101.0}}, r"logit_bias\[5\]=101.0"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias key -1 is not a token id"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias key '5' is not a token id"),
        ({"bad_words_ids": [()]}, "non-empty sequence of token ids"),
        ({"bad_words_ids": [(1, -2)]}, "non-empty sequence of token ids"),
    ]:
        with pytest.raises(MoLoRAError, match=msg):
            SamplingParams(**kw)
    p = SamplingParams(bad_words_ids=[[1, 2], [3]], logit_bias={4: -100.0})
    assert p.bad_words_ids == ((1, 2), (3,)) and p.adjusts_logits
    assert not SamplingParams(min_p=0.5, presence_penalty=0.0, repetition_penalty=1.0).adjusts_logits


# ------------------------------------------------------------------------------------------ the engine

N = 24


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    eng = routed_engine(tmp_path_factory.mktemp("adapters"), kv_budget_tokens=2048)
    eng.eos_ids = frozenset()  # every request runs max_new_tokens
    return eng


def run(engine: Engine, params: list[SamplingParams]) -> list[list[int]]:
    outs = engine.generate(PROMPTS[: len(params)], params)
    engine.check()
    return [o.new_token_ids for o in outs]


def repeats(tokens: list[int]) -> int:
    return len(tokens) - len(set(tokens))


def test_greedy_tokens_are_unchanged_with_knobs_off_and_beside_rows_that_use_them(engine):
    off = run(engine, [SamplingParams(max_new_tokens=N)] * 4)
    # neutral knobs send every row through the adjusted copy: the same tokens
    neutral = SamplingParams(max_new_tokens=N, logit_bias={0: 0.0})
    assert neutral.adjusts_logits
    assert run(engine, [neutral] * 4) == off
    # rows 1 and 3 use real knobs; rows 0 and 2 keep their tokens
    strong = SamplingParams(max_new_tokens=N, frequency_penalty=2.0, logit_bias={off[1][0]: -100.0})
    mixed = run(engine, [SamplingParams(max_new_tokens=N), strong, SamplingParams(max_new_tokens=N), strong])
    assert (mixed[0], mixed[2]) == (off[0], off[2])
    assert mixed[1] != off[1]


def test_penalties_reduce_repetition_on_a_tiny_model(engine):
    off = run(engine, [SamplingParams(max_new_tokens=N)] * 4)
    assert sum(repeats(t) for t in off) > 0  # the tiny random model loops: something to penalize
    for knob in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 5.0}):
        on = run(engine, [SamplingParams(max_new_tokens=N, **knob)] * 4)
        assert sum(repeats(t) for t in on) < sum(repeats(t) for t in off), knob


def test_logit_bias_forces_and_bans_tokens(engine):
    off = run(engine, [SamplingParams(max_new_tokens=N)] * 2)
    forced = run(engine, [SamplingParams(max_new_tokens=N, logit_bias={77: 100.0})] * 2)
    assert forced == [[77] * N] * 2
    banned = off[0][0]
    got = run(engine, [SamplingParams(max_new_tokens=N, logit_bias={banned: -100.0})] * 2)
    assert all(banned not in t for t in got)
    # sampled rows obey too (each from its own seeded generator)
    hot = [SamplingParams(max_new_tokens=N, temperature=1.0, seed=s, logit_bias={banned: -100.0}) for s in (1, 2)]
    assert all(banned not in t for t in run(engine, hot))


def test_bad_words_never_appear(engine):
    off = run(engine, [SamplingParams(max_new_tokens=N)] * 4)
    single = off[0][0]
    pair = (off[1][2], off[1][3])
    words = ((single,), pair)
    got = run(engine, [SamplingParams(max_new_tokens=N, bad_words_ids=words)] * 4)
    for t in got:
        assert single not in t
        assert all((a, b) != pair for a, b in zip(t, t[1:]))
    assert got != off


def test_the_engine_refuses_knob_ids_outside_the_vocabulary(engine):
    with pytest.raises(MoLoRAError, match="outside the vocabulary"):
        engine.add_request([1, 2], SamplingParams(logit_bias={engine.vocab_size: 1.0}))
    with pytest.raises(MoLoRAError, match="outside the vocabulary"):
        engine.add_request([1, 2], SamplingParams(bad_words_ids=[(3, engine.vocab_size + 5)]))
    assert not engine.requests


# ------------------------------------------------------------------------------------------ server


@pytest.fixture
def engine_fake() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(engine_fake):
    with TestClient(create_app(engine_fake, max_queue=64), raise_server_exceptions=True) as c:
        yield c


def test_server_accepts_each_knob_and_passes_it_on(client, engine_fake):
    base = {"model": "toy", "prompt": "ab", "max_tokens": 3}
    for body, field, want in [
        ({"presence_penalty": 1.5}, "presence_penalty", 1.5),
        ({"frequency_penalty": -2}, "frequency_penalty", -2.0),
        ({"repetition_penalty": 1.2}, "repetition_penalty", 1.2),
        ({"min_p": 0.1}, "min_p", 0.1),
        ({"logit_bias": {"97": 100, "3": -100}}, "logit_bias", {97: 100.0, 3: -100.0}),
        # the toy tokenizer is one token per byte: " ab" is another length, so only "ab" itself is banned
        ({"bad_words": ["ab", "c"]}, "bad_words_ids", ((97, 98), (99,))),
        ({"repetition_penalty": None, "min_p": None}, "repetition_penalty", 1.0),
    ]:
        r = client.post("/v1/completions", json={**base, **body})
        assert r.status_code == 200, (body, r.text)
        assert getattr(engine_fake.added[-1]["params"], field) == want, body
    chat = {"model": "toy", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    r = client.post("/v1/chat/completions", json={**chat, "frequency_penalty": 0.5, "logit_bias": {"5": 1}})
    assert r.status_code == 200, r.text
    p = engine_fake.added[-1]["params"]
    assert (p.frequency_penalty, p.logit_bias) == (0.5, {5: 1.0})


def test_server_refuses_bad_knob_values_naming_the_parameter(client, engine_fake):
    n = len(engine_fake.added)
    base = {"model": "toy", "prompt": "ab", "max_tokens": 3}
    post = client.post
    for body, param in [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": "0.1"}, "min_p"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"-3": 1}}, "logit_bias"),
        ({"logit_bias": {" 5": 1}}, "logit_bias"),
        ({"logit_bias": {"259": 1}}, "logit_bias"),  # the toy vocabulary is [0, 259)
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
        ({"bad_words": ["x"] * 257}, "bad_words"),
        ({"bad_words": [""]}, "bad_words.0"),
        ({"bad_words": "ab"}, "bad_words"),
    ]:
        err = assert_error(post("/v1/completions", json={**base, **body}), 400, param)
        if param == "logit_bias" and "abc" in body.get("logit_bias", {}):
            assert "'abc'" in err["message"]
    assert len(engine_fake.added) == n  # nothing refused reached the engine
