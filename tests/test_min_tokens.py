"""vLLM's `ignore_eos` and `min_tokens` on the real engine (tiny random model) and through the server: ignore_eos
generates max_new_tokens even when greedy picks eos (stop_token_ids still stop), min_tokens forbids every kind
of stop for its first N tokens and changes only the tokens that would have been a stop id, in its own row."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from molora.config import SamplingParams
from molora.engine import Engine, EngineConfig
from molora.errors import MoLoRAError
from molora.model.attach import attach
from molora.routing import VocabRouter
from molora.server import create_app
from tests.conftest import make_peft_adapter, tiny_model
from tests.test_server import EOS, IM_END, FakeEngine, ToyTokenizer, assert_error

PROMPTS = [[5, 70, 9, 11], [80, 81, 3], [7, 7, 100, 2, 66], [40, 90]]
N = 8


def routed_engine(root, kv_budget_tokens: int = 1024) -> Engine:
    """A tiny Qwen3 with two seeded adapters under a vocab router and the toy tokenizer (also test_sampling_knobs')."""
    adapters = {n: make_peft_adapter(root / n, "qwen3", seed=i) for i, n in enumerate(("math", "code"))}
    mm = attach(
        tiny_model("qwen3"),
        adapters,
        router=VocabRouter([(0, 64, "math")], default="code"),
        tokenizer=ToyTokenizer(),
        check_base=False,
    )
    return Engine(mm, EngineConfig(max_model_len=256, kv_budget_tokens=kv_budget_tokens))


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    return routed_engine(tmp_path_factory.mktemp("adapters"))


def gen(engine: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], eos: set[int]):
    """[(tokens, finish_reason, text, logprobs)] with the engine's eos ids set to `eos`."""
    engine.eos_ids = frozenset(eos)
    outs = engine.generate(prompts, params)
    engine.check()
    assert not engine.requests and not engine.hotset.pins
    return [(o.new_token_ids, o.finish_reason, o.new_text, o.logprobs) for o in outs]


def test_ignore_eos_generates_max_new_tokens_when_greedy_picks_eos(engine):
    ((free, _, _, _),) = gen(engine, PROMPTS[:1], SamplingParams(max_new_tokens=N), set())
    assert len(free) == N
    eos = free[0]  # the first greedy token is now the model's eos
    ((tokens, reason, _, _),) = gen(engine, PROMPTS[:1], SamplingParams(max_new_tokens=N), {eos})
    assert (tokens, reason) == ([eos], "stop")
    ((tokens, reason, _, _),) = gen(engine, PROMPTS[:1], SamplingParams(max_new_tokens=N, ignore_eos=True), {eos})
    assert (tokens, reason) == (free, "length")
    # as vLLM: ignore_eos ignores the eos ids only; the request's stop_token_ids still end it
    k = next(i for i, t in enumerate(free) if t != eos)
    p = SamplingParams(max_new_tokens=N, ignore_eos=True, stop_token_ids=(free[k],))
    ((tokens, reason, _, _),) = gen(engine, PROMPTS[:1], p, {eos})
    assert (tokens, reason) == (free[: k + 1], "stop")


def test_min_tokens_masks_only_the_stop_ids_and_holds_back_every_stop(engine):
    ((free, _, _, lps),) = gen(engine, PROMPTS[:1], SamplingParams(max_new_tokens=N, logprobs=2), set())
    k = next(i for i, t in enumerate(free) if t not in free[:i] and i >= 1)  # a token first produced at k
    eos = free[k]
    ((tokens, reason, _, _),) = gen(engine, PROMPTS[:1], SamplingParams(max_new_tokens=N), {eos})
    assert (tokens, reason) == (free[: k + 1], "stop")

    ((tokens, reason, _, got_lps),) = gen(
        engine, PROMPTS[:1], SamplingParams(max_new_tokens=N, min_tokens=k + 1, logprobs=2), {eos}
    )
    assert tokens[:k] == free[:k]  # greedy where no eos was masked: the unmasked run's tokens
    runner_up = lps[k]["top"][1][0]  # position k: eos masked, the second best wins
    assert tokens[k] == runner_up != eos
    assert got_lps[k]["top"] == lps[k]["top"]  # logprobs stay the model's (vLLM's raw logprobs)
    assert len(tokens) > k + 1 and eos not in tokens[: k + 1]
    assert reason == "length" or (reason == "stop" and tokens[-1] == eos)

    # the request's stop_token_ids are masked too; min_tokens == max_new_tokens gives exactly max_new_tokens
    p = SamplingParams(max_new_tokens=N, min_tokens=N, stop_token_ids=tuple(free[:3]))
    ((tokens, reason, _, _),) = gen(engine, PROMPTS[:1], p, {eos})
    assert len(tokens) == N and reason == "length" and not set(tokens) & {eos, *free[:3]}


def test_min_tokens_does_not_search_its_tokens_for_stop_strings(engine):
    ((free, _, text, _),) = gen(engine, PROMPTS[:1], SamplingParams(max_new_tokens=N), set())
    stop = text[0]  # the first token's character: a stop at once
    ((tokens, reason, got, _),) = gen(engine, PROMPTS[:1], SamplingParams(max_new_tokens=N, stop=(stop,)), set())
    assert (tokens, reason, got) == (free[:1], "stop", "")
    p = SamplingParams(max_new_tokens=N, stop=(stop,), min_tokens=3)
    ((tokens, reason, got, _),) = gen(engine, PROMPTS[:1], p, set())
    later = [i for i in range(3, N) if text[i] == stop]  # the first occurrence after the min_tokens stops it
    if later:
        assert (tokens, reason, got) == (free[: later[0] + 1], "stop", text[: later[0]])
    else:
        assert (tokens, reason, got) == (free, "length", text)


def test_min_tokens_in_a_batch_leaves_the_other_rows_alone(engine):
    ((free, _, _, _),) = gen(engine, PROMPTS[:1], SamplingParams(max_new_tokens=N), set())
    eos = {free[1], free[2]}  # the min_tokens row would stop early without its mask
    plain = SamplingParams(max_new_tokens=N)
    alone = [gen(engine, [p], plain, eos)[0][:2] for p in PROMPTS[1:]]
    sampled = SamplingParams(max_new_tokens=N, temperature=0.8, seed=7)
    alone_sampled = gen(engine, PROMPTS[1:2], sampled, eos)[0][:2]

    params = [SamplingParams(max_new_tokens=N, min_tokens=N - 1)] + [plain] * 3 + [sampled]
    got = gen(engine, PROMPTS + PROMPTS[1:2], params, eos)
    assert [g[:2] for g in got[1:4]] == alone and got[4][:2] == alone_sampled
    tokens, reason = got[0][:2]
    assert len(tokens) >= N - 1 and not eos & set(tokens[: N - 1])

    # sampled with min_tokens: seeded, reproducible, never an eos among its first min_tokens
    p = SamplingParams(max_new_tokens=N, temperature=1.0, seed=3, min_tokens=N)
    a, b = (gen(engine, PROMPTS[:1], p, eos)[0] for _ in range(2))
    assert a[:2] == b[:2] and len(a[0]) == N and not eos & set(a[0])


def test_sampling_params_validate_min_tokens():
    with pytest.raises(MoLoRAError, match="min_tokens=-1 must be >= 0"):
        SamplingParams(min_tokens=-1)
    with pytest.raises(MoLoRAError, match="min_tokens=9 exceeds max_new_tokens=8"):
        SamplingParams(max_new_tokens=8, min_tokens=9)
    assert SamplingParams(max_new_tokens=8, min_tokens=8, ignore_eos=True).min_tokens == 8


# ------------------------------------------------------------------------------------------ server


def test_server_passes_ignore_eos_and_min_tokens_and_refuses_bad_values(client, engine_fake):
    post = client.post
    r = post("/v1/completions", json={"model": "toy", "prompt": "ab", "max_tokens": 5, "min_tokens": 3})
    assert r.status_code == 200, r.text
    p = engine_fake.added[-1]["params"]
    assert (p.min_tokens, p.ignore_eos, p.stop_token_ids) == (3, False, (EOS, IM_END))

    r = post(
        "/v1/chat/completions",
        json={
            "model": "toy",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 4,
            "ignore_eos": True,
            "min_tokens": 4,
        },
    )
    assert r.status_code == 200, r.text
    p = engine_fake.added[-1]["params"]
    # ignore_eos drops the model's end ids (tokenizer eos, end of turn), as vLLM drops its generation-config eos
    assert (p.min_tokens, p.ignore_eos, p.stop_token_ids, p.max_new_tokens) == (4, True, (), 4)

    n = len(engine_fake.added)
    base = {"model": "toy", "prompt": "a", "max_tokens": 4}
    assert_error(post("/v1/completions", json={**base, "min_tokens": -1}), 400, "min_tokens")
    assert_error(post("/v1/completions", json={**base, "min_tokens": "2"}), 400, "min_tokens")
    assert_error(post("/v1/completions", json={**base, "min_tokens": 1.5}), 400, "min_tokens")
    assert_error(post("/v1/completions", json={**base, "ignore_eos": "yes"}), 400, "ignore_eos")
    err = assert_error(post("/v1/completions", json={**base, "min_tokens": 5}), 400, "min_tokens")
    assert "min_tokens=5" in err["message"] and "4" in err["message"]
    chat = {"model": "toy", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2}
    assert_error(post("/v1/chat/completions", json={**chat, "min_tokens": 3}), 400, "min_tokens")
    assert len(engine_fake.added) == n  # nothing refused reached the engine
    assert post("/v1/completions", json=base).status_code == 200


@pytest.fixture
def engine_fake() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(engine_fake):
    with TestClient(create_app(engine_fake, max_queue=64), raise_server_exceptions=True) as c:
        yield c
