"""The compatibility table (docs/serving.md, tools/make_compat.py) says what the server does: each field it lists as
refused gets a 400 naming it, each note is about a declared field, the rendered block is current; and the vLLM and
OpenAI fields added for clients behave as vLLM's do."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from molora.server import create_app
from tests.conftest import load_script
from tests.test_server import IM_END, FakeEngine

compat = load_script("make_compat")


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(FakeEngine(), max_queue=64)) as c:
        yield c


def _refused(endpoint_fields: set[str], names: list[str]) -> list[str]:
    return [n for n in dict.fromkeys(names) if n not in endpoint_fields]


BODIES = {
    "/v1/chat/completions": ({"model": "toy", "messages": [{"role": "user", "content": "a"}], "max_tokens": 2}, "chat"),
    "/v1/completions": ({"model": "toy", "prompt": "a", "max_tokens": 2}, "completions"),
}


@pytest.mark.parametrize("path", list(BODIES))
def test_every_field_the_table_calls_refused_gets_a_400_naming_it(client, path):
    body, which = BODIES[path]
    model = compat.ChatCompletionRequest if which == "chat" else compat.CompletionRequest
    listed = (compat.OPENAI_CHAT if which == "chat" else compat.OPENAI_COMPLETIONS) + compat.VLLM
    refused = _refused(compat.fields(model), listed)
    assert refused  # the table has refusals to check
    for name in refused:
        r = client.post(path, json={**body, name: 1})
        assert r.status_code == 400, (name, r.text)
        assert r.json()["error"]["param"] == name and "unrecognized request argument" in r.json()["error"]["message"]
    assert client.post(path, json=body).status_code == 200


def test_every_note_is_about_a_declared_field_and_the_block_is_current():
    declared = compat.fields(compat.ChatCompletionRequest) | compat.fields(compat.CompletionRequest)
    assert set(compat.NOTES) <= declared, set(compat.NOTES) - declared
    assert compat.main(["--check"]) == 0, "run: python -m tools.make_compat"


def test_the_endpoint_rows_follow_the_app(client):
    served = {(m, r.path) for r in client.app.routes for m in getattr(r, "methods", ()) or ()}
    for (method, path), _ in compat.ENDPOINTS.items():
        status = client.request(method, path, json={}).status_code
        assert (status != 404) == ((method, path) in served), (method, path, status)


def test_stop_token_ids_end_generation_and_are_checked(client):
    engine = client.app.state.molora.client.engine
    r = client.post("/v1/completions", json={"model": "toy", "prompt": "a", "stop_token_ids": [7, 8, 8]})
    assert r.status_code == 200
    assert (
        engine.added[-1]["params"].stop_token_ids[-2:] == (7, 8) and IM_END in engine.added[-1]["params"].stop_token_ids
    )
    r = client.post("/v1/completions", json={"model": "toy", "prompt": "a", "stop_token_ids": [7], "ignore_eos": True})
    assert engine.added[-1]["params"].stop_token_ids == (7,)
    r = client.post("/v1/completions", json={"model": "toy", "prompt": "a", "stop_token_ids": [999]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"


def test_chat_template_kwargs_reach_the_template_and_cannot_replace_the_servers(client, monkeypatch):
    tok = client.app.state.molora.catalog.infos["toy"].tokenizer
    seen: list[dict] = []
    real = tok.apply_chat_template

    def spy(conversation, add_generation_prompt=True, tokenize=False, **kw):
        seen.append(kw)
        return real(conversation, add_generation_prompt=add_generation_prompt, tokenize=tokenize)

    monkeypatch.setattr(tok, "apply_chat_template", spy)
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}]
    r = client.post(
        "/v1/chat/completions",
        json={"model": "toy", "messages": msgs, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}},
    )
    assert r.status_code == 200, r.text and seen[-1] == {"enable_thinking": False}
    for key in ("tools", "add_generation_prompt", "messages"):
        r = client.post(
            "/v1/chat/completions",
            json={"model": "toy", "messages": msgs, "max_tokens": 2, "chat_template_kwargs": {key: 1}},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text


def test_openai_storage_fields_are_accepted_and_do_nothing(client):
    body = {"model": "toy", "messages": [{"role": "user", "content": "a"}], "max_tokens": 2}
    r = client.post("/v1/chat/completions", json={**body, "store": False, "metadata": {"team": "x"}})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("name", ["sampling_knobs_cost", "tool_call_cost", "structured_bounds"])
def test_the_cost_lines_in_serving_md_are_renders_of_their_records(name):
    """A record changed without re-rendering fails here: run `python -m experiments.<name> --render-only`."""
    import json

    module = load_script(name)
    assert module.render(json.loads(module.RECORD.read_text())) in module.PAGE.read_text()
