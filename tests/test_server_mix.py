"""Mixes and scales over HTTP: `molora.mix`, `molora.scale` with model=<adapter>, POST /v1/mixes and named mixes in
/v1/models (parent: the base) give what the engine gives for the same mix, and every bad one answers 400 naming its
field with nothing changed."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient

import molora
from molora.config import LLAMA_PROJECTIONS, SamplingParams
from molora.engine import Engine, EngineConfig
from molora.server import create_app
from tests.conftest import make_peft_adapter, tiny_model
from tests.test_server import ToyTokenizer, assert_error

CFG = EngineConfig(max_num_seqs=8, block_size=4, kv_budget_tokens=1024, max_model_len=128, stop_at_eos=False)
PROMPT = [5, 70, 9, 33, 12]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix-server")
    return {n: make_peft_adapter(root / n, "qwen3", seed=30 + i) for i, n in enumerate("abc")}


def _engine(paths, slots: int | None = None) -> Engine:
    names = ("a", "b") if slots == 2 else ("a", "b", "c")
    mm = molora.attach(
        tiny_model("qwen3"),
        {n: paths[n] for n in names},
        target_modules=LLAMA_PROJECTIONS,
        tokenizer=ToyTokenizer(),
        check_base=False,
        slots=slots,
    )
    engine = Engine(mm, CFG)
    if slots == 2:
        engine.register_adapters({"c": paths["c"]})  # known, never resident with both others: three adapters, 2 slots
    return engine


@pytest.fixture
def http(paths):
    with TestClient(create_app(_engine(paths), model_name="tiny")) as c:
        yield c


def _ids(http, model: str, molora_opts: dict) -> list[int]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = http.post("/v1/completions", json={**body, "molora": {**molora_opts, "return_routing": True}})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["molora"]["token_ids"]


@torch.no_grad()
def _want(paths, **kw) -> list[int]:
    return _engine(paths).generate([PROMPT], SamplingParams(max_new_tokens=6, ignore_eos=True), **kw)[0].new_token_ids


def test_mix_and_scale_over_http_equal_the_engine(http, paths):
    mix = {"a": 0.7, "b": -0.3}
    assert _ids(http, "tiny", {"mix": mix}) == _want(paths, mix=mix)
    assert _ids(http, "b", {"scale": 0.5}) == _want(paths, adapter="b", scale=0.5)
    assert _ids(http, "tiny:b", {"scale": 0.5}) == _want(paths, adapter="b", scale=0.5)
    assert _ids(http, "tiny", {"mix": mix}) != _ids(http, "a", {})


def test_named_mix_registers_lists_and_serves_like_the_inline_mix(http, paths):
    r = http.post("/v1/mixes", json={"name": "sql_chat", "adapters": {"a": 0.5, "c": 0.5}})
    assert r.status_code == 201, r.text
    assert r.json()["model"] == "sql_chat" and r.json()["adapters"] == {"a": 0.5, "c": 0.5}
    cards = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert cards["sql_chat"]["parent"] == "tiny" and cards["sql_chat"]["mix"] == {"a": 0.5, "c": 0.5}
    assert "mix" not in cards["a"] and cards["a"]["parent"] == "tiny"
    assert http.get("/v1/models/sql_chat").json()["mix"] == {"a": 0.5, "c": 0.5}
    want = _want(paths, mix={"a": 0.5, "c": 0.5})
    assert _ids(http, "sql_chat", {}) == want
    assert _ids(http, "tiny", {"mix": "sql_chat"}) == want
    assert_error(
        http.post("/v1/completions", json={"model": "sql_chat", "prompt": PROMPT, "molora": {"mix": {"a": 1.0}}}),
        400,
        "molora.mix",
    )


def test_bad_mixes_answer_400_naming_the_field_and_change_nothing(paths):
    with TestClient(create_app(_engine(paths, slots=2), model_name="tiny")) as http:
        models = http.get("/v1/models").json()
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
        for opts, param, words in [
            ({"mix": {"zz": 1.0}}, "molora.mix", "unknown adapter"),
            ({"mix": {"a": 2.5}}, "molora.mix", "within"),
            ({"mix": {"a": 0.3, "b": 0.3, "c": 0.4}}, "molora.mix", "2 slots"),
            ({"mix": {}}, "molora.mix", "non-empty"),
            ({"mix": "nope"}, "molora.mix", "unknown mix"),
            ({"mix": {"a": "x"}}, "molora.mix.a", "valid number"),
            ({"scale": 0.5}, "molora.scale", "pinned adapter"),
        ]:
            err = assert_error(http.post("/v1/completions", json={**body, "molora": opts}), 400, param)
            assert words in err["message"], (opts, err)
        err = assert_error(
            http.post("/v1/completions", json={**body, "model": "a", "molora": {"scale": 5.0}}), 400, "molora.scale"
        )
        assert "outside" in err["message"]
        for mix_body, param in [
            ({"name": "a", "adapters": {"b": 1.0}}, "name"),  # an adapter's name
            ({"name": "tiny", "adapters": {"b": 1.0}}, "name"),  # the served model's
            ({"name": "m", "adapters": {"zz": 1.0}}, "adapters"),
            ({"name": "m", "adapters": {"a": -2.5}}, "adapters"),
            ({"name": "m", "adapters": {"a": 0.3, "b": 0.3, "c": 0.4}}, "adapters"),
            ({"name": "m", "adapters": {}}, "adapters"),
            ({"name": "has space", "adapters": {"a": 1.0}}, "name"),
        ]:
            assert_error(http.post("/v1/mixes", json=mix_body), 400, param)
        assert http.get("/v1/models").json() == models
        assert http.post("/v1/completions", json={**body, "molora": {"mix": {"a": 0.5, "b": 0.5}}}).status_code == 200


def test_serve_flag_sets_the_engines_mix_bound(monkeypatch, capsys):
    """`molora serve --max-mix-weight W` reaches EngineConfig.max_mix_weight (a bad value is refused there)."""
    import molora.server
    from molora.cli import main

    seen = {}
    monkeypatch.setattr(molora.server, "serve", lambda bundle, **kw: seen.update(kw))
    assert main(["serve", "--max-mix-weight", "0.5"]) == 0
    assert seen["engine_config"].max_mix_weight == 0.5
    assert main(["serve", "--max-mix-weight", "-1"]) != 0
    assert "EngineConfig.max_mix_weight=-1.0 must be a positive finite number" in capsys.readouterr().err


def test_a_mix_registered_as_router_expert_serves_the_routed_tokens_on_the_mix(paths):
    """POST /v1/mixes with "router_expert": true makes the mix an expert of the bundle's learned router (here gates that
    send every token to a): a routed request then answers as the static mix; a model without an in-network router
    answers 400 naming router_expert, nothing registered."""
    from molora.routing.learned import LearnedRouter, LearnedRouterConfig, decoder_layers

    engine = _engine(paths)
    mm = engine.mm
    router = LearnedRouter(LearnedRouterConfig(("a", "b", "c"), mm.config.hidden_size, len(decoder_layers(mm.model))))
    with torch.no_grad():
        router.bias.fill_(-20.0)
        router.bias[:, 0] = 5.0
    mm.router = router
    with TestClient(create_app(engine, model_name="tiny")) as http:
        r = http.post("/v1/mixes", json={"name": "ab", "adapters": {"a": 0.7, "b": 0.3}, "router_expert": True})
        assert r.status_code == 201, r.text
        assert r.json()["router_expert"] is True
        assert _ids(http, "tiny", {}) == _want(paths, mix={"a": 0.7, "b": 0.3})
        models = http.get("/v1/models").json()
        assert {m["id"] for m in models["data"]} >= {"tiny", "a", "b", "c", "ab"}
    with TestClient(create_app(_engine(paths), model_name="tiny")) as http:
        models = http.get("/v1/models").json()
        body = {"name": "ab", "adapters": {"a": 0.7, "b": 0.3}, "router_expert": True}
        err = assert_error(http.post("/v1/mixes", json=body), 400, "router_expert")
        assert "in-network router" in err["message"]
        assert http.get("/v1/models").json() == models
