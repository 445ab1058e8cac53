"""`molora serve --ray` end to end: a local Ray cluster on 127.0.0.1, tiny random bundles, two engine replicas.

One module-scoped cluster (Ray and Serve start once, ~25 s on 2 cores); every test talks HTTP to the ingress
or calls the engine deployment through a handle. Teardown checks that no Ray process is left.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray

from molora.bundle import write_manifest  # noqa: E402
from molora.config import SamplingParams  # noqa: E402
from molora.server import ServerThread, build_engine, create_app  # noqa: E402
from molora.server import ray_serve as rs  # noqa: E402
from molora.server.launch import free_port  # noqa: E402
from molora.server.runner import RequestSpec  # noqa: E402
from tests.conftest import make_peft_adapter, private_rng, tiny_config, tiny_model, tiny_tokenizer  # noqa: E402

MAX_LEN = 2048
ENGINE = {"max_model_len": MAX_LEN, "kv_budget_tokens": 8192, "max_num_seqs": 16}


def make_bundles(root: Path) -> dict[str, Path]:
    """Bundles alpha, beta, gamma on one tiny Llama base (long context), two adapters each, no router."""
    from transformers import AutoModelForCausalLM

    base = root / "base"
    config = tiny_config("llama")
    config.max_position_embeddings = MAX_LEN
    with private_rng():  # its own init is overwritten below: leave the process RNG as it was
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(tiny_model("llama").state_dict())
    model.save_pretrained(str(base))
    tiny_tokenizer().save_pretrained(str(base))
    out = {}
    for k, name in enumerate(("alpha", "beta", "gamma")):
        folder = root / name
        adapters = []
        for i in range(2):
            a = f"{name[0]}{i}"
            make_peft_adapter(folder / "adapters" / a, "llama", seed=10 * k + i)
            adapters.append({"name": a, "path": f"adapters/{a}"})
        write_manifest(
            folder,
            {
                "format": "molora-bundle/1",
                "name": name,
                "base": str(base),
                "prompt_template": "w3 {prompt} w4",
                "stop": ["<|im_end|>"],
                "adapters": adapters,
                "router": {"kind": "none"},
                "slots": 4,
            },
        )
        out[name] = folder
    return out


def _ray_processes() -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "raylet" in cmd or "gcs_server" in cmd or cmd.startswith("ray::"):
            found.append(f"{pid}: {cmd[:80]}")
    return found


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray")
    bundles = make_bundles(root / "bundles")
    assert not _ray_processes(), "a Ray cluster is already running on this machine"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _temp_dir=str(root / "ray"))
    port = free_port()
    try:
        cfg = rs.RayConfig(
            bundles=(str(bundles["alpha"]), str(bundles["beta"])),
            replicas=2,
            max_queue=4,
            ray_queue=2,
            threads_per_replica=1,
            cpus_per_replica=0.5,
            engine_config=ENGINE,
            ingress="serve",
        )
        rs.serve_ray(cfg, port=port, block=False)
        yield {"url": f"http://127.0.0.1:{port}/v1", "bundles": bundles, "root": root}
    finally:
        rs.shutdown()
        deadline = time.monotonic() + 30
        while _ray_processes() and time.monotonic() < deadline:
            time.sleep(0.5)
        left = _ray_processes()
        assert not left, f"Ray processes left after shutdown: {left}"


@pytest.fixture(scope="module")
def reference(cluster):
    """The in-process server on bundle alpha: what --ray must reproduce token for token."""
    from molora.engine import EngineConfig

    engine = build_engine(cluster["bundles"]["alpha"], EngineConfig(**ENGINE))
    with ServerThread(create_app(engine, max_queue=64)) as url:
        yield url, engine


def test_openai_client_through_ray_equals_the_in_process_server(cluster, reference):
    import openai

    ray_client = openai.OpenAI(base_url=cluster["url"], api_key="none", max_retries=0)
    local_client = openai.OpenAI(base_url=reference[0], api_key="none", max_retries=0)
    for model in ("alpha", "alpha:a1", "a0"):
        kw = dict(model=model, max_tokens=24, temperature=0)
        chat = [
            c.chat.completions.create(messages=[{"role": "user", "content": "w5 w6 w7"}], **kw)
            for c in (ray_client, local_client)
        ]
        assert chat[0].choices[0].message.content == chat[1].choices[0].message.content
        comp = [c.completions.create(prompt="w9 w10 w11 w12", **kw) for c in (ray_client, local_client)]
        assert comp[0].choices[0].text == comp[1].choices[0].text and comp[0].usage == comp[1].usage
        streams = [
            "".join(
                ch.choices[0].delta.content or ""
                for ch in c.chat.completions.create(
                    messages=[{"role": "user", "content": "w20 w21"}], stream=True, **kw
                )
                if ch.choices
            )
            for c in (ray_client, local_client)
        ]
        assert streams[0] == streams[1] and streams[0]
    listed = {m.id: m.model_extra.get("parent") for m in ray_client.models.list().data}
    assert listed == {"alpha": None, "a0": "alpha", "a1": "alpha", "beta": None, "b0": "beta", "b1": "beta"}


def test_named_and_inline_mixes_through_ray_equal_the_in_process_server(cluster, reference):
    """POST /v1/mixes on the --ray ingress reaches the replicas (a new bundle version, as a run-time adapter): the
    named mix, as a model and as molora.mix, and an inline mix answer token for token as on the local server."""
    url, engine = reference
    mix = {"a0": 0.6, "a1": -0.4}
    for base in (cluster["url"], url):
        r = httpx.post(base + "/mixes", json={"name": "alpha_mix", "adapters": mix, "bundle": "alpha"}, timeout=60)
        assert r.status_code == 201, r.text
    body = {"prompt": "w9 w10 w11 w12", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    asks = [
        {"model": "alpha_mix"},
        {"model": "alpha", "molora": {"mix": "alpha_mix"}},
        {"model": "alpha", "molora": {"mix": {"a0": 0.3, "a1": 0.7}}},
    ]
    texts = []
    for ask in asks:
        got = [httpx.post(base + "/completions", json={**body, **ask}, timeout=120) for base in (cluster["url"], url)]
        assert [g.status_code for g in got] == [200, 200], [g.text for g in got]
        texts.append([g.json()["choices"][0]["text"] for g in got])
        assert texts[-1][0] == texts[-1][1], ask
    assert texts[0][0] == texts[1][0] and texts[0][0] != texts[2][0]  # the named mix ran, not the inline one
    listed = {m["id"]: m.get("mix") for m in httpx.get(cluster["url"] + "/models", timeout=30).json()["data"]}
    assert listed["alpha_mix"] == mix
    bad = {"name": "alpha_mix2", "adapters": mix, "bundle": "alpha", "router_expert": True}  # alpha has no router
    r = httpx.post(cluster["url"] + "/mixes", json=bad, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "router_expert", r.text
    assert "alpha_mix2" not in {m["id"] for m in httpx.get(cluster["url"] + "/models", timeout=30).json()["data"]}


def test_repeats_of_a_bundle_stay_on_one_replica(cluster):
    with httpx.Client(base_url=cluster["url"], timeout=60) as c:
        seen = {
            m: {
                c.post("/completions", json={"model": m, "prompt": "w5", "max_tokens": 2}).headers["x-molora-replica"]
                for _ in range(6)
            }
            for m in ("beta", "beta:b0", "alpha")
        }
    assert len(seen["beta"]) == 1 and seen["beta"] == seen["beta:b0"] and len(seen["alpha"]) == 1


def _engine_stats(bundle_spec: rs.BundleSpec) -> dict:
    from ray import serve

    handle = serve.get_deployment_handle(rs.ENGINE_DEPLOYMENT, app_name=rs.APP_NAME)
    kind, stats = handle.options(multiplexed_model_id=bundle_spec.name).command.remote(bundle_spec, "stats").result()
    assert kind == "ok"
    return stats


def test_a_disconnect_frees_the_engine_kv_blocks(cluster):
    spec = rs.bundle_specs([str(cluster["bundles"]["alpha"])])[0]
    body = {"model": "alpha", "prompt": "w5 w6", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=cluster["url"], timeout=60) as c:
        with c.stream("POST", "/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            busy = _engine_stats(spec)
        assert busy["num_running"] == 1 and busy["kv_blocks_free"] < busy["kv_blocks_total"]
    deadline = time.monotonic() + 20
    while (s := _engine_stats(spec))["num_running"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert s["num_running"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]


def test_saturation_gives_429_and_the_server_keeps_serving(cluster):
    body = {"model": "alpha", "prompt": "w5", "max_tokens": 1500, "ignore_eos": True}  # seconds each: all overlap

    async def main():
        async with httpx.AsyncClient(base_url=cluster["url"], timeout=120) as c:
            return await asyncio.gather(*[c.post("/completions", json=body) for _ in range(24)])

    answers = asyncio.run(main())
    codes = sorted(r.status_code for r in answers)
    odd = [r.text[:200] for r in answers if r.status_code not in (200, 429)]
    assert set(codes) == {200, 429}, (codes, odd)  # 2 replicas x 4 running + 2 queued, the rest refused
    assert all(r.headers.get("retry-after") for r in answers if r.status_code == 429)
    with httpx.Client(base_url=cluster["url"], timeout=60) as c:
        assert c.post("/completions", json={**body, "max_tokens": 4}).status_code == 200


def test_eviction_during_a_stream_leaves_its_output_unchanged(cluster):
    """One replica that keeps one bundle: a request for beta evicts alpha while alpha streams."""
    from ray import serve

    bundles = cluster["bundles"]
    cfg = rs.RayConfig(
        bundles=(str(bundles["alpha"]), str(bundles["beta"])),
        replicas=1,
        max_queue=4,
        bundles_per_replica=1,
        threads_per_replica=1,
        cpus_per_replica=0.5,
        engine_config=ENGINE,
    )
    specs = rs.bundle_specs(cfg.bundles)
    serve.run(rs.make_app(cfg, specs, {}), name="evict", route_prefix=None)
    handle = serve.get_deployment_handle(rs.ENGINE_DEPLOYMENT, app_name="evict")
    prompt = [3, 5, 6, 7, 4]
    params = SamplingParams(max_new_tokens=1200, temperature=0.0, ignore_eos=True)

    async def main():
        client = rs.RayClient(handle, rs.Registry(specs))
        spec = RequestSpec(0, prompt, params)
        sub = await client.submit([spec], "a", "alpha")
        tokens = []
        first = await sub.queue.get()
        tokens += first[1].new_token_ids
        short = await client.submit([RequestSpec(0, prompt, SamplingParams(max_new_tokens=2))], "b", "beta")
        while short.unfinished:
            _, out = await short.queue.get()
            if out.finished:
                short.finished(out.request_id)
        short.close()
        during = await handle.info.remote()
        while sub.unfinished:
            _, out = await sub.queue.get()
            tokens += out.new_token_ids
            if out.finished:
                sub.finished(out.request_id)
        sub.close()
        deadline = time.monotonic() + 10
        while "alpha" in (after := await handle.info.remote())["leases"] and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return tokens, during, after

    try:
        tokens, during, after = asyncio.run(main())
    finally:
        serve.delete("evict")
    from molora.engine import EngineConfig

    engine = build_engine(bundles["alpha"], EngineConfig(**ENGINE))  # in process, same bundle
    want = engine.generate([prompt], params)[0].new_token_ids
    assert tokens == want and len(tokens) == 1200
    assert during["builds"] == 2 and during["leases"]["alpha"] == {"holders": 0, "sequences": 1, "version": 0}
    assert after["builds"] == 2 and "alpha" not in after["leases"]  # freed once its stream ended


def test_process_ingress_over_the_engine_handle_equals_the_in_process_server(cluster, reference):
    """--ray-ingress process: the same app, run by uvicorn in this (driver) process, reaching the engine
    replicas through a deployment handle with no Ray proxy in between."""
    import openai
    from ray import serve

    from molora.server.generation import REPLICA_HEADER

    specs = rs.bundle_specs([str(cluster["bundles"]["alpha"]), str(cluster["bundles"]["beta"])])
    cfg = rs.RayConfig(bundles=tuple(s.path for s in specs), max_queue=4, engine_config=ENGINE, ingress="process")
    handle = serve.get_deployment_handle(rs.ENGINE_DEPLOYMENT, rs.APP_NAME)
    with ServerThread(rs.ingress_app(handle, cfg, specs, {})) as url:
        clients = [openai.OpenAI(base_url=u, api_key="none", max_retries=0) for u in (url, reference[0])]
        kw = dict(model="alpha:a0", max_tokens=24, temperature=0)
        streams = [
            "".join(
                ch.choices[0].text for ch in c.completions.create(prompt="w30 w31 w32", stream=True, **kw) if ch.choices
            )
            for c in clients
        ]
        assert streams[0] == streams[1] and streams[0]
        r = httpx.post(url + "/completions", json={"prompt": "w5", "model": "alpha", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.headers[REPLICA_HEADER]
        bad = httpx.post(url + "/completions", json={"prompt": "w5", "model": "nope"}, timeout=30)
        assert bad.status_code == 404


async def _pinned_call(client, adapter: str, i: int) -> tuple[str, bool]:
    """One call pinned to `adapter` through `client`, drained: (its replica, whether its adapter was in a slot)."""
    from molora.server.runner import RequestSpec

    before = {r: list(x) for r, x in client.placements.items()}
    sub = await client.submit([RequestSpec(0, [5, 6, 7], SamplingParams(max_new_tokens=2), adapter)], f"p{i}", "delta")
    try:
        while sub.unfinished:
            item = await sub.queue.get()
            assert isinstance(item, tuple), item
            if item[1].finished:
                sub.finished(item[1].request_id)
    finally:
        sub.close()
    hits = client.placements[sub.replica][1] - before.get(sub.replica, [0, 0])[1]
    return sub.replica, bool(hits)


@pytest.mark.slow
def test_a_call_goes_to_the_replica_whose_slots_hold_its_adapter(cluster):
    """--ray-placement adapters: six adapters (two in the bundle, four loaded at run time), two slots per replica,
    two replicas holding the bundle; a call
    pinned to the adapter the previous call used finds it in a slot (Ray's choice by bundle alone picks either
    replica, and the other one does not hold it)."""
    from ray import serve

    from molora.server.ray_client import RayClient
    from molora.server.ray_state import Registry

    folder = cluster["root"] / "delta"
    names = [f"d{i}" for i in range(6)]
    for i, a in enumerate(names):
        make_peft_adapter(folder / "adapters" / a, "llama", seed=40 + i)
    manifest = {"format": "molora-bundle/1", "name": "delta", "base": str(cluster["bundles"]["alpha"].parent / "base")}
    manifest |= {"adapters": [{"name": a, "path": f"adapters/{a}"} for a in names[:2]], "router": {"kind": "none"}}
    write_manifest(folder, {**manifest, "prompt_template": "w3 {prompt} w4", "slots": 2})
    cfg = rs.RayConfig(
        bundles=(str(folder),),
        replicas=2,
        max_queue=2,
        ray_queue=16,
        threads_per_replica=1,
        cpus_per_replica=0.5,
        engine_config=ENGINE,
    )
    specs = rs.bundle_specs(cfg.bundles)
    handle = serve.run(rs.engine_deployment(cfg, specs), name="placement", route_prefix=None)
    try:

        async def go() -> list[tuple[str, bool]]:
            client = RayClient(handle, Registry(specs))
            for a in names[2:]:  # a bundle holds at most its slots' worth: the rest come at run time, as by POST
                await client.load_adapter("delta", a, folder / "adapters" / a, [folder])
            await asyncio.gather(*(_pinned_call(client, "d0", i) for i in range(6)))  # a burst: both take the bundle
            assert len(client.placements) == 2, client.placements
            return [await _pinned_call(client, a, 10 + i) for i, a in enumerate(["d1", "d1", "d2", "d2", "d3", "d3"])]

        calls = asyncio.run(go())
    finally:
        serve.delete("placement")
    repeats = calls[1::2]
    assert all(hit for _, hit in repeats), calls
    assert [r for r, _ in repeats] == [r for r, _ in calls[0::2]], calls  # the repeat went where the first went


def test_ray_config_rejects_an_unknown_ingress():
    with pytest.raises(rs.MoLoRAError, match="--ray-ingress 'proxy'"):
        rs.RayConfig(ingress="proxy")
