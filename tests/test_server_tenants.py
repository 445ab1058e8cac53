"""Tenants through the server: a request's tenant (named key, else `user`, else the pinned adapter, else "default")
and its `priority` reach the engine; per-tenant limits answer 429 with Retry-After naming the tenant's limit; the
flags parse. The engine is the deterministic fake of tests/test_server.py; the token window runs on a fake clock."""

from __future__ import annotations

import httpx
import pytest
from fastapi.testclient import TestClient

from molora.errors import MoLoRAError
from molora.server import ServerThread, create_app
from molora.server.tenants import TenantLimits, parse_api_keys, tenant_of
from tests.test_server import FakeEngine, assert_error, wait_for

KEYS = ("alice=sk-alice", "sk-plain")


def _post(client: TestClient, key: str | None = None, **body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return client.post(
        "/v1/completions", json={"model": "toy", "prompt": "q", "max_tokens": 2, **body}, headers=headers
    )


def test_the_tenant_is_the_key_name_else_user_else_the_adapter():
    engine = FakeEngine()
    with TestClient(create_app(engine, api_keys=KEYS)) as client:
        assert _post(client, "sk-alice", user="mallory").status_code == 200  # a named key wins over `user`
        assert _post(client, "sk-plain", user="bob").status_code == 200
        assert _post(client, "sk-plain", model="toy:math").status_code == 200
        assert _post(client, "sk-plain").status_code == 200
        assert_error(_post(client, "alice"), 401)  # the name is not a key
        assert_error(_post(client, "alice=sk-alice"), 401)
    assert [r["tenant"] for r in engine.added] == ["alice", "bob", "math", "default"]


def test_priority_reaches_the_engine_and_is_checked():
    engine = FakeEngine()
    with TestClient(create_app(engine)) as client:
        assert _post(client, priority=-3).status_code == 200
        assert_error(_post(client, priority="high"), 400, "priority")
        assert_error(_post(client, priority=2**70), 400, "priority")
        assert_error(_post(client, user="u" * 257), 400, "user")  # a tenant name becomes a label: bounded
    assert [r["priority"] for r in engine.added] == [-3]


def test_a_tenant_over_its_in_flight_limit_gets_429_and_others_do_not():
    engine = FakeEngine(step_delay=0.01)
    app = create_app(engine, max_queue=8, tenant_limits=TenantLimits(max_queued=1))
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=10) as http:
        body = {"model": "toy", "prompt": "a", "max_tokens": 100, "stream": True, "user": "flood"}
        with http.stream("POST", "/completions", json=body) as s1:
            lines = s1.iter_lines()  # keep a reference: a collected iterator closes the connection
            next(lines)
            r = http.post("/completions", json={"model": "toy", "prompt": "b", "user": "flood"})
            err = assert_error(r, 429)
            assert err["code"] == "tenant_limit" and r.headers["retry-after"] == "1"
            assert (
                "tenant 'flood' has 1 requests in flight" in err["message"] and "--tenant-max-queued" in err["message"]
            )
            two = http.post("/completions", json={"model": "toy", "prompt": "b", "n": 2, "user": "calm"})
            assert_error(two, 429)  # n=2 is two engine requests, over a limit of 1
            assert http.post("/completions", json={"model": "toy", "prompt": "b", "user": "calm"}).status_code == 200
        wait_for(lambda: not engine.running)
        wait_for(lambda: not app.state.molora.tenants.in_flight)
        assert http.post("/completions", json={"model": "toy", "prompt": "b", "user": "flood"}).status_code == 200


def test_tokens_per_minute_count_prompt_and_completion_tokens_in_a_sliding_window():
    engine = FakeEngine()
    app = create_app(engine, tenant_limits=TenantLimits(tokens_per_minute=10))
    now = [100.0]
    app.state.molora.tenants.clock = lambda: now[0]
    with TestClient(app) as client:
        assert _post(client, prompt="abcdef", max_tokens=4, user="t").status_code == 200  # 6 + 4 tokens at t=100
        now[0] = 130.0
        r = _post(client, user="t")
        err = assert_error(r, 429)
        assert err["code"] == "tenant_limit" and r.headers["retry-after"] == "30"
        assert "tenant 't' used 10 tokens in the last 60 s" in err["message"]
        assert "10 tokens per minute (--tenant-tokens-per-minute)" in err["message"]
        assert _post(client, user="u").status_code == 200  # another tenant's window is its own
        now[0] = 160.5
        assert _post(client, user="t").status_code == 200
    assert len(engine.added) == 3


def test_key_names_limits_and_flags_parse():
    assert parse_api_keys(["alice=sk-1", "sk-2", "sk-3=="]) == {"sk-1": "alice", "sk-2": None, "sk-3==": None}
    with pytest.raises(MoLoRAError, match="--tenant-max-queued 0"):
        TenantLimits(max_queued=0)
    assert (
        tenant_of(None, None, None) == "default"
        and tenant_of("k", "u", "a") == "k"
        and tenant_of(None, "u", "a") == "u"
    )
    from molora.cli import build_parser

    args = build_parser().parse_args(
        ["serve", "--scheduling-policy", "fair", "--tenant-max-queued", "4", "--tenant-tokens-per-minute", "900"]
    )
    assert (args.scheduling_policy, args.tenant_max_queued, args.tenant_tokens_per_minute) == ("fair", 4, 900)
    assert build_parser().parse_args(["serve"]).scheduling_policy == "fcfs"
