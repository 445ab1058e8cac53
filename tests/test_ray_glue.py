"""molora.server.ray_serve without a Ray cluster: registry versions, bundle leases, the replica logic, and the
app over `RayClient` with a fake deployment handle giving the same bytes as the in-process server."""

from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from molora.errors import MoLoRAError
from molora.server.app import build_app, create_app, model_info
from molora.server.generation import Catalog
from molora.server.ray_client import RayClient
from molora.server.ray_replica import EngineReplica
from molora.server.ray_state import BundleSpec, Leases, Registry
from molora.server.runner import Saturated
from tests.test_server import FakeEngine, ToyTokenizer, expected_text

# ------------------------------------------------------------------------------------------ fakes


class FakeStream:
    """The part of Ray's DeploymentResponseGenerator the client uses: async iteration and cancel()."""

    def __init__(self, agen) -> None:
        self.agen, self.cancelled = agen, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.agen.__anext__()

    def cancel(self) -> None:  # Ray raises CancelledError in the replica's generator; closing it does the same
        self.cancelled = True
        asyncio.ensure_future(self.agen.aclose())


class FakeHandle:
    """A deployment handle over in-process `EngineReplica`s with Ray's multiplexing rules, simplified: a bundle
    goes to the replica holding it, else to the replica with the fewest bundles; `evict` drops one."""

    def __init__(self, replicas: list[EngineReplica], saturate: bool = False) -> None:
        self.replicas, self.saturate = replicas, saturate
        self.resident: list[dict] = [{} for _ in replicas]  # per replica: bundle id -> Resident
        self.ids: list[str] = []  # multiplexed ids asked for, in order

    def options(self, stream: bool = False, multiplexed_model_id: str = "") -> SimpleNamespace:
        self.ids.append(multiplexed_model_id)
        model_id = multiplexed_model_id

        async def gen(spec, specs, prefix):
            if self.saturate:
                raise Saturated("fake backpressure")
            replica, resident = await self._resident(spec, model_id)
            async for m in replica.generate(resident, spec, specs, prefix):
                yield m

        async def run(spec, op):
            replica, resident = await self._resident(spec, model_id)
            return await replica.command(resident, spec, op)

        return SimpleNamespace(
            generate=SimpleNamespace(remote=lambda *a: FakeStream(gen(*a))),
            command=SimpleNamespace(remote=lambda *a: run(*a)),
        )

    async def _resident(self, spec: BundleSpec, model_id: str):
        assert spec.name == model_id, "the multiplexed id is the bundle"
        i = next((i for i, r in enumerate(self.resident) if model_id in r), None)
        if i is None:
            i = min(range(len(self.replicas)), key=lambda k: len(self.resident[k]))
            self.resident[i][model_id] = await self.replicas[i].load(spec)
        return self.replicas[i], self.resident[i][model_id]

    def evict(self, bundle: str) -> None:
        for r in self.resident:
            if bundle in r:
                r.pop(bundle).__del__()


def toy_info(adapters=("math", "code")):
    engine = FakeEngine()
    return model_info(
        "toy", ToyTokenizer(), engine.mm.bundle, config=engine.mm.config, max_model_len=128, adapters=list(adapters)
    )


def ray_app(n_replicas: int = 1, step_delay: float = 0.0, **kwargs):
    engines: list[FakeEngine] = []

    def build(path):
        engines.append(FakeEngine(step_delay=step_delay))
        return engines[-1]

    replicas = [EngineReplica(build, max_in_flight=64, name=f"replica-{i}") for i in range(n_replicas)]
    handle = FakeHandle(replicas)
    registry = Registry([BundleSpec("toy", None, adapters={"math": None, "code": None})])
    app = build_app(RayClient(handle, registry, max_in_flight=64), Catalog([toy_info()]), **kwargs)
    return app, handle, registry, engines


def normalized(text: str) -> str:
    text = re.sub(r'"id":"[a-z]+-[0-9a-f]+"', '"id":"X"', text)
    return re.sub(r'"created":\d+', '"created":0', text)


# ------------------------------------------------------------------------------------------ registry and leases


def test_registry_versions_and_conflicting_changes():
    reg = Registry([BundleSpec("b", None, adapters={"a": None})])
    v1 = reg.with_adapter("b", "x", "/r/x")
    assert reg.spec("b").version == 0 and reg.adapters("b") == ["a"]  # nothing counts before commit
    reg.commit(v1)
    assert reg.spec("b").version == 1 and reg.adapters("b") == ["a", "x"]
    v2 = reg.without_adapter("b", "a", force=True)
    stale = reg.with_adapter("b", "y", "/r/y")  # made on version 1 too
    reg.commit(v2)
    assert reg.adapters("b") == ["x"] and reg.spec("b").forced == {"a"}
    with pytest.raises(MoLoRAError, match="changed meanwhile"):
        reg.commit(stale)


def test_registry_carries_named_mixes_and_their_router_expert_flag_by_version():
    reg = Registry([BundleSpec("b", None, adapters={"a": None, "c": None})])
    v1 = reg.with_mix("b", "m", {"a": 0.5, "c": 0.5}, router_expert=True)
    assert reg.spec("b").mixes == {} and v1.version == 1  # nothing counts before commit
    reg.commit(v1)
    reg.commit(reg.with_mix("b", "m", {"a": 0.2, "c": 0.8}))  # replaced, its flag kept
    assert reg.spec("b").mixes == {"m": {"a": 0.2, "c": 0.8}} and reg.spec("b").mix_experts == {"m": True}
    reg.commit(reg.with_mix("b", "m", {"a": 0.2, "c": 0.8}, router_expert=False))
    assert reg.spec("b").mix_experts == {"m": False} and reg.spec("b").version == 3


class FakeRunner:
    def stop(self) -> None:
        pass


def make_leases():
    closed: list[str] = []

    async def build(name):
        return SimpleNamespace(name=name), FakeRunner()

    return Leases(build, close=lambda lease: closed.append(lease.name)), closed


def test_a_second_release_is_a_no_op():
    async def main():
        leases, closed = make_leases()
        r = await leases.acquire("b")
        r.release()
        r.release()
        r.__del__()  # Ray calls __del__, then the garbage collector does
        return leases, closed

    leases, closed = asyncio.run(main())
    assert closed == ["b"] and leases.leases == {}


def test_release_during_two_running_sequences_frees_after_the_last():
    async def main():
        leases, closed = make_leases()
        r = await leases.acquire("b")
        lease = r.lease
        leases.begin(lease)
        leases.begin(lease)
        r.__del__()  # evicted while two sequences run
        assert closed == [] and not lease.closed
        leases.end(lease)
        assert closed == []
        leases.end(lease)
        assert closed == ["b"] and lease.closed
        with pytest.raises(Exception, match="released"):
            leases.begin(lease)

    asyncio.run(main())


def test_a_bundle_being_released_comes_back_without_a_reload():
    async def main():
        leases, closed = make_leases()
        r1 = await leases.acquire("b")
        leases.begin(r1.lease)
        r1.release()  # evicted mid-stream
        r2 = await leases.acquire("b")  # a request for it arrives
        assert r2.lease is r1.lease and leases.builds == 1
        leases.end(r1.lease)  # the stream ends: still held by r2
        assert closed == []
        r2.release()
        assert closed == ["b"]
        r3 = await leases.acquire("b")  # freed: a new load
        assert r3.lease is not r1.lease and leases.builds == 2

    asyncio.run(main())


def test_concurrent_loads_of_one_bundle_build_once():
    async def main():
        gate = asyncio.Event()
        built = []

        async def build(name):
            built.append(name)
            await gate.wait()
            return SimpleNamespace(), FakeRunner()

        leases = Leases(build, close=lambda lease: None)
        tasks = [asyncio.ensure_future(leases.acquire("b")) for _ in range(3)]
        await asyncio.sleep(0)
        gate.set()
        residents = await asyncio.gather(*tasks)
        assert built == ["b"] and len({id(r.lease) for r in residents}) == 1 and residents[0].lease.holders == 3

    asyncio.run(main())


# ------------------------------------------------------------------------------------------ the app over RayClient

CHAT = {
    "model": "toy",
    "messages": [{"role": "user", "content": "abc"}],
    "max_tokens": 6,
    "stream": True,
    "molora": {"return_routing": True},
    "stream_options": {"include_usage": True},
}
ONE = {**CHAT, "stream": False, "stream_options": None}


def test_ray_client_gives_the_same_sse_bytes_as_the_in_process_server():
    app, handle, _, _ = ray_app()
    with TestClient(create_app(FakeEngine(), max_queue=64)) as local, TestClient(app) as remote:
        for body in (CHAT, {**CHAT, "model": "toy:math"}, {**CHAT, "n": 2, "stream": False, "stream_options": None}):
            a, b = local.post("/v1/chat/completions", json=body), remote.post("/v1/chat/completions", json=body)
            assert a.status_code == b.status_code == 200
            assert normalized(a.text) == normalized(b.text)
            assert b.headers["x-molora-replica"] == "replica-0" and "x-molora-replica" not in a.headers
        completion = {"model": "toy", "prompt": "hi", "max_tokens": 5}
        assert normalized(local.post("/v1/completions", json=completion).text) == normalized(
            remote.post("/v1/completions", json=completion).text
        )
    assert set(handle.ids) == {"toy"}  # "toy:math" maps to the bundle's id


def test_errors_cross_the_client_as_the_same_answers():
    app, handle, _, engines = ray_app()
    with TestClient(app) as c:
        r = c.post("/v1/chat/completions", json={**CHAT, "model": "toy:nope"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        too_long = {**ONE, "max_tokens": 500}
        assert c.post("/v1/chat/completions", json=too_long).status_code == 400
        handle.saturate = True
        r = c.post("/v1/chat/completions", json=ONE)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        handle.saturate = False
        assert c.post("/v1/chat/completions", json=ONE).status_code == 200


def test_a_stream_closed_early_aborts_its_engine_requests():
    # 100 steps of 20 ms: the request cannot end on its own before the client closes (without a delay a fast
    # engine could finish all 100 tokens first, and there would be nothing left to abort)
    app, handle, _, engines = ray_app(step_delay=0.02)
    with TestClient(app) as c:
        body = {**CHAT, "max_tokens": 100}
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            next(r.iter_lines())
        deadline = __import__("time").monotonic() + 5
        while engines[0].running and __import__("time").monotonic() < deadline:
            __import__("time").sleep(0.01)
        assert not engines[0].running and engines[0].aborted


def test_run_time_adapters_reach_every_replica_through_the_registry(tmp_path):
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "adapter_config.json").write_text("{}")
    app, handle, registry, engines = ray_app(n_replicas=2, adapter_roots=[tmp_path])
    with TestClient(app) as c:
        assert c.post("/v1/chat/completions", json=ONE).status_code == 200
        bad = c.post("/v1/adapters", json={"name": "broken", "path": str(tmp_path)})
        assert bad.status_code == 404 and registry.spec("toy").version == 0  # no adapter there: nothing changed
        r = c.post("/v1/adapters", json={"name": "extra", "path": "extra"})
        assert r.status_code == 201 and registry.spec("toy").version == 1
        assert "extra" in engines[0].mm.adapter_names  # the replica that checked it
        ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
        assert ids == ["toy", "math", "code", "extra"]  # vLLM's form: adapters by name, parent = the base
        handle.evict("toy")  # the next load is another engine
        handle.resident[0]["other"] = object()  # ...on the other replica
        r = c.post("/v1/chat/completions", json={**ONE, "model": "toy:extra"})
        assert r.status_code == 200 and r.headers["x-molora-replica"] == "replica-1"
        assert "extra" in engines[1].mm.adapter_names  # caught up before running
        assert c.delete("/v1/adapters/extra").status_code == 200
        assert "extra" not in engines[1].mm.adapter_names and registry.spec("toy").version == 2
        r = c.post("/v1/chat/completions", json={**ONE, "model": "toy:extra"})
        assert r.status_code == 404
        listed = c.get("/v1/adapters").json()["data"]
        assert [a["name"] for a in listed] == ["math", "code"]


def test_greedy_text_through_the_client_matches_the_engine_contract():
    app, _, _, _ = ray_app()
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"model": "toy", "prompt": "xyz", "max_tokens": 7})
        assert r.json()["choices"][0]["text"] == expected_text(list(b"xyz"), 7)
        events = [
            json.loads(line[6:])
            for line in c.post("/v1/chat/completions", json=CHAT).text.splitlines()
            if line.startswith("data: {")
        ]
        assert events[-1]["usage"]["completion_tokens"] == 6


def test_bad_scale_out_settings_are_one_line_errors(capsys):
    from molora.cli import main
    from molora.server.ray_serve import RayConfig

    assert main(["serve", "--bundle", "a", "--bundle", "b"]) == 2
    assert capsys.readouterr().err.strip().endswith("add --ray to serve several")
    with pytest.raises(MoLoRAError, match="both --min-replicas and --max-replicas"):
        RayConfig(min_replicas=1)
    with pytest.raises(MoLoRAError, match="min-replicas"):
        RayConfig(min_replicas=3, max_replicas=2)
    with pytest.raises(MoLoRAError, match="at least 1"):
        RayConfig(replicas=0)
    assert RayConfig(replicas=2, threads_per_replica=None).threads >= 1


def test_core_molora_never_imports_ray():
    import subprocess
    import sys

    code = (
        "import sys, molora, molora.server, molora.server.app, molora.engine, molora.cli; print('ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------------------------------ --lora-dir with --ray


def test_lora_dir_adapters_reach_a_replica_cold_and_one_is_read_on_first_use(tmp_path):
    """`--ray --lora-dir DIR`: the ingress lists every subfolder of DIR as an adapter of each bundle (only which
    folders exist is read); a replica registers them without reading a weights file, and reads one when a request
    first needs it, giving the tokens of that adapter loaded on its own."""
    import shutil

    import torch

    import molora
    from molora.adapters.io import WEIGHTS_FILE
    from molora.bundle import default_bundle_dir, read_bundle
    from molora.config import SamplingParams
    from molora.engine import Engine, EngineConfig
    from molora.server.ray_serve import bundle_specs
    from molora.server.runner import RequestSpec
    from tests.conftest import VOCAB, make_peft_adapter, tiny_model
    from tests.test_adapter_registry import ARCH, CFG, config_only, engine_of

    source = make_peft_adapter(tmp_path / "src" / "real", ARCH, r=4, seed=7)
    root = config_only(tmp_path / "many", source, 40)
    shutil.copy(source / WEIGHTS_FILE, root / "ad0007" / WEIGHTS_FILE)  # the one a request will use

    (default,) = bundle_specs([None], lora_dirs=[root])  # the ingress's view: the embedded bundle plus the folder
    own = [a.name for a in read_bundle(default_bundle_dir()).adapters]
    assert list(default.adapters) == own + [f"ad{i:04d}" for i in range(40)]
    assert default.cold == {f"ad{i:04d}" for i in range(40)} and default.adapters["ad0007"] == str(root / "ad0007")
    (root / own[0]).mkdir()
    shutil.copy(source / "adapter_config.json", root / own[0] / "adapter_config.json")
    with pytest.raises(MoLoRAError, match=rf"--lora-dir adapters \['{own[0]}'\] have the names of bundle"):
        bundle_specs([None], lora_dirs=[root])
    shutil.rmtree(root / own[0])

    engines: list[Engine] = []

    def build(path):
        engines.append(engine_of(source))
        return engines[-1]

    cold = {n: p for n, p in default.adapters.items() if n in default.cold}
    spec = BundleSpec("toy", None, adapters={"base0": None, **cold}, cold=default.cold)
    prompt = torch.randint(3, VOCAB, (6,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_new_tokens=4)
    replica = EngineReplica(build, max_in_flight=8, name="replica-0")

    async def main():
        resident = await replica.load(spec)
        tokens = []
        async for m in replica.generate(resident, spec, [RequestSpec(0, prompt, params, adapter="ad0007")], "c"):
            assert m[0] in ("accepted", "outs"), m
            if m[0] == "outs":
                tokens += [t for _, out in m[1] for t in out.new_token_ids]
        listed = await resident.lease.runner.call(engines[0].list_adapters)
        reads = engines[0].hotset.disk_reads
        resident.release()
        return tokens, listed, reads

    tokens, listed, reads = asyncio.run(main())
    tiers = {a["name"]: a["tier"] for a in listed}
    assert len(tiers) == 41 and tiers["ad0007"] == "slot" and tiers["ad0030"] == "disk"
    assert reads == 1  # only the adapter the request used was read
    alone = Engine(molora.attach(tiny_model(ARCH), {"solo": source}), EngineConfig(**CFG))
    assert tokens == alone.generate([prompt], params, adapter="solo")[0].new_token_ids


def test_tenant_and_priority_reach_the_replicas_engine():
    """A request's tenant (the OpenAI `user` field here, else its pinned adapter) and its `priority` travel in the
    request spec to the engine on the replica, as they reach a local engine."""
    app, _, _, engines = ray_app()
    with TestClient(app) as c:
        body = {"model": "toy", "prompt": "q", "max_tokens": 2}
        assert c.post("/v1/completions", json={**body, "user": "alice", "priority": -2}).status_code == 200
        assert c.post("/v1/completions", json={**body, "model": "toy:math"}).status_code == 200
    added = [r for e in engines for r in e.added]
    assert [(r["tenant"], r["priority"]) for r in added] == [("alice", -2), ("math", 0)]
