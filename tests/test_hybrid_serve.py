"""`--router hybrid` served: the per-request chooser's calibration at start-up (cached on disk, keyed by the base and
the adapters' contents), its pick per request through the OpenAI endpoints, the bypasses, and bad settings refused.

Tiny random Llama base and PEFT adapters, each drawn from its own generator."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import httpx
import pytest
import torch

import molora
from molora.engine import EngineConfig
from molora.errors import BundleError, RoutingError
from molora.server.app import create_app
from molora.server.launch import ServerThread, build_engine
from tests.conftest import make_peft_adapter, save_eos_prone_base

TEMPLATE = "w3 {prompt} w4"
ENGINE = EngineConfig(max_num_seqs=8, max_model_len=128, kv_budget_tokens=2048)
ROUTER = {
    "kind": "hybrid",
    "arrow": {
        "granularity": "per_block",
        "prompt": True,
        "rms_threshold": 1.0,
        "prompt_share": 0.5,
        "prompt_window": 4,
        "source_block": -1,
        "calibration_prompts": 8,
    },
    "z_or": None,
    "pool_n": 16,
    "pool_seed": 5,
    "pool_batch": 16,
    "pool_max_new_tokens": 6,
}
PROMPTS = [" ".join(f"w{5 + (7 * k + 3 * j) % 100}" for j in range(3 + k % 6)) for k in range(10)]


def _bundle(root: Path, router: dict = ROUTER, adapters: int = 2) -> Path:
    """A tiny Llama whose base model ends a turn (eos, id 1) often, and `adapters` PEFT adapters; router `router`."""
    from molora.bundle import write_manifest

    base = root / "base"
    if not base.exists():
        save_eos_prone_base(base)
    entries = []
    for i in range(adapters):
        path = root / f"e{i}"
        if not path.exists():
            make_peft_adapter(path, "llama", seed=i)
        entries.append({"name": f"e{i}", "path": str(path)})
    folder = root / "bundle"
    folder.mkdir(exist_ok=True)
    (folder / "molora.json").unlink(missing_ok=True)
    manifest = {"name": "d", "base": str(base), "adapters": entries, "prompt_template": TEMPLATE}
    write_manifest(folder, {**manifest, "stop": ["<|im_end|>"], "router": router})
    return folder


@pytest.fixture
def served(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("MOLORA_HYBRID_CACHE", str(tmp_path / "cache"))
    return _bundle(tmp_path)


def _post(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    return http.post(path, json={"max_tokens": 5, "temperature": 0, **body})


def test_served_pick_is_the_choosers_own_and_the_request_runs_on_it(served):
    engine = build_engine(served, ENGINE)
    offline = molora.load(served)  # a second load: the calibration is read back from the cache
    picks = offline.chooser.choose_per_request(offline, PROMPTS)
    assert len(set(picks)) >= 2 and None in picks  # base and an adapter both picked: the test can tell them apart
    with ServerThread(create_app(engine)) as url, httpx.Client(base_url=url, timeout=60) as http:
        for prompt, pick in zip(PROMPTS, picks):
            chat = _post(
                http,
                "/chat/completions",
                {"model": "d", "messages": [{"role": "user", "content": prompt}], "molora": {"return_routing": True}},
            ).json()["choices"][0]
            assert chat["molora"]["chooser"]["adapter"] == pick and chat["molora"]["chooser"]["kind"] == "hybrid"
            assert set(chat["molora"]["adapters"]) <= {pick}  # every token ran on the pick (None: the base)
            alone = {"model": pick} if pick else {"model": "d", "molora": {"adapters": []}}  # the base: none allowed
            msg = [{"role": "user", "content": prompt}]
            pinned = _post(http, "/chat/completions", {**alone, "messages": msg}).json()["choices"][0]
            assert chat["message"]["content"] == pinned["message"]["content"]
        batch = _post(http, "/completions", {"model": "d", "prompt": PROMPTS[:4], "n": 2}).json()["choices"]
        assert [c["molora"]["chooser"]["adapter"] for c in sorted(batch, key=lambda c: c["index"])] == [
            p for p in picks[:4] for _ in range(2)
        ]  # completions: the chooser reads each prompt; its n choices share its pick
        metrics = http.get(url.removesuffix("/v1") + "/metrics").text
    for name in set(picks):  # asked once per chat and per completion prompt; a pinned adapter bypasses it
        want = picks.count(name) * (2 if name is None else 1) + picks[:4].count(name)
        assert f'molora_chooser_choices_total{{adapter="{name or "base"}"}} {float(want)}' in metrics


def test_streaming_reports_the_pick_and_equals_the_full_answer(served):
    with ServerThread(create_app(build_engine(served, ENGINE))) as url, httpx.Client(base_url=url, timeout=60) as h:
        body = {"model": "d", "messages": [{"role": "user", "content": PROMPTS[1]}]}
        full = _post(h, "/chat/completions", body).json()["choices"][0]
        events = [
            json.loads(line[6:])
            for line in _post(h, "/chat/completions", {**body, "stream": True}).text.splitlines()
            if line.startswith("data: {")
        ]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    last = [e["choices"][0] for e in events if e["choices"] and e["choices"][0].get("finish_reason")]
    assert text == full["message"]["content"]
    assert last[0]["molora"]["chooser"] == full["molora"]["chooser"]


def test_bypasses_and_a_failing_chooser_answers_that_request_alone(served):
    engine = build_engine(served, ENGINE)
    with ServerThread(create_app(engine)) as url, httpx.Client(base_url=url, timeout=60) as http:
        msg = [{"role": "user", "content": PROMPTS[2]}]
        pinned = _post(http, "/chat/completions", {"model": "e1", "messages": msg}).json()["choices"][0]
        assert "chooser" not in (pinned.get("molora") or {})  # model=ADAPTER pins it: the chooser is not asked
        none = _post(http, "/chat/completions", {"model": "d", "messages": msg, "molora": {"adapters": []}}).json()
        assert none["choices"][0]["molora"]["chooser"]["adapter"] is None  # nothing allowed: the base model
        explicit = _post(http, "/chat/completions", {"model": "d", "messages": msg, "molora": {"routing": "arrow"}})
        assert explicit.status_code == 400 and "router" in explicit.json()["error"]["message"]  # not asked: refused
        real = engine.mm.chooser.served_stages
        calls = []

        def broken(mm, questions, allowed=None, batch_size=16, busy=None):  # fails in its second stage, pinned
            calls.append(1)
            yield None
            raise RuntimeError("boom")

        object.__setattr__(engine.mm.chooser, "served_stages", broken)
        bad = _post(http, "/chat/completions", {"model": "d", "messages": msg})
        assert bad.status_code == 500 and bad.json()["error"]["code"] == "chooser_error"
        assert "boom" in bad.json()["error"]["message"] and calls
        assert not any(engine.hotset.pins.values())  # the failed choice's pins are gone
        object.__setattr__(engine.mm.chooser, "served_stages", real)
        assert _post(http, "/chat/completions", {"model": "d", "messages": msg}).status_code == 200  # still serving
        metrics = http.get(url.removesuffix("/v1") + "/metrics").text
    assert 'molora_chooser_choices_total{adapter="error"} 1.0' in metrics


def test_calibration_is_cached_and_a_changed_adapter_recomputes_its_own_alone(served, monkeypatch):
    from safetensors.torch import load_file, save_file

    import molora.calibration as cal

    first_mm = molora.load(served)
    first = first_mm.chooser
    files = sorted(p.name.split("-")[0] for p in (served.parent / "cache").glob("*.json"))
    assert files == ["entropy", "entropy", "pool"] and len(list((served.parent / "cache").glob("arrow-*.pt"))) == 1
    calls: list[int] = []
    real = cal.first_token_entropy

    def counted(mm, rows, **k):
        calls.append(len(rows))
        return real(mm, rows, **k)

    monkeypatch.setattr(cal, "first_token_entropy", counted)
    monkeypatch.setattr(cal, "sample_pool", lambda *a, **k: pytest.fail("the pool was drawn again"))
    from molora.routing.arrow import ArrowRouter

    monkeypatch.setattr(ArrowRouter, "calibrate", lambda *a, **k: pytest.fail("Arrow's calibration was measured again"))
    restarted = molora.load(served)
    again = restarted.chooser
    assert calls == [] and again.chooser == first.chooser  # a restart reads everything back
    assert again.choose_per_request(restarted, PROMPTS) == first.choose_per_request(first_mm, PROMPTS)
    f = served.parent / "e1" / "adapter_model.safetensors"
    save_file({k: v * 1.5 if "lora_B" in k else v for k, v in load_file(str(f)).items()}, str(f))
    changed = molora.load(served).chooser
    assert calls == [ROUTER["pool_n"]]  # one adapter's entropies over the pool, the other read back
    assert changed.chooser.mean[0] == first.chooser.mean[0] and changed.chooser.mean[1] != first.chooser.mean[1]


def test_the_staged_choice_equals_the_choice_in_one_go_and_unpins_when_closed(served):
    """The server's choice (Engine.choose_stages) runs one forward pass per stage while other requests are in the
    engine, and all its passes as one when none is: the same picks as Engine.choose either way, its adapters
    pinned from its first stage until it ends or is closed half-way."""
    from molora.config import SamplingParams
    from molora.engine import Engine, EngineConfig

    engine = Engine(molora.load(served), EngineConfig(max_num_seqs=4))
    whole = engine.choose(list(PROMPTS))

    def stages_of(choice) -> int:
        n = 0
        while True:
            try:
                next(choice)
                n += 1
                assert any(engine.hotset.pins.values())  # pinned between stages
            except StopIteration as end:
                assert [c["adapter"] for c in end.value] == [c["adapter"] for c in whole]
                return n

    assert stages_of(engine.choose_stages(list(PROMPTS))) == 0  # an idle engine: one forward, no pause
    assert not any(engine.hotset.pins.values())
    rid = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=2))  # another request waits for the engine
    assert stages_of(engine.choose_stages(list(PROMPTS))) == len(engine.mm.chooser.adapter_names)
    assert engine.choose(list(PROMPTS)) == engine.choose(list(PROMPTS))  # busy: the separate passes, every time
    half = engine.choose_stages(list(PROMPTS))
    next(half)
    assert any(engine.hotset.pins.values())
    half.close()  # a client gave up
    assert not any(engine.hotset.pins.values())
    engine.abort(rid)


def test_the_joint_pass_equals_the_separate_passes_and_the_allowed_set_limits_the_pick(served):
    from molora.routing.confidence import first_token_entropy
    from molora.routing.hybrid import arrow_claim_share, joint_pass, variants_pass

    mm = molora.load(served)
    h = mm.chooser
    rows = [mm.tokenizer(TEMPLATE.replace("{prompt}", q), add_special_tokens=False)["input_ids"] for q in PROMPTS]
    share, ent = joint_pass(h._router(mm), mm, rows, [1, 0], batch=5)  # prompts of different lengths, 1 per forward
    assert torch.allclose(share, arrow_claim_share(h._router(mm), mm, rows, batch=4))
    assert torch.allclose(ent, first_token_entropy(mm, rows, adapters=[1, 0]), rtol=1e-4, atol=1e-5)
    part_share, part = variants_pass(h._router(mm), mm, rows, [0], batch=3)  # the passes a busy choice has left
    assert part_share is None and torch.allclose(part[:, 0], ent[:, 1], rtol=1e-4, atol=1e-5)
    with pytest.raises(RoutingError, match="at most once"):
        variants_pass(h._router(mm), mm, rows, [0, -1, 0])
    separate = h.choose_served(mm, PROMPTS)
    object.__setattr__(h, "joint", True)
    assert [c["adapter"] for c in h.choose_served(mm, PROMPTS)] == [c["adapter"] for c in separate]
    only = h.choose_served(mm, PROMPTS, allowed=["e1"])
    assert {c["adapter"] for c in only} <= {"e1", None} and all(set(c["z"]) == {"e1"} for c in only)
    assert [c["adapter"] for c in h.choose_served(mm, PROMPTS, allowed=[])] == [None] * len(PROMPTS)


def test_bad_settings_and_flags_are_refused_with_the_fix(tmp_path, monkeypatch, capsys):
    from molora.bundle import read_bundle
    from molora.cli import main

    monkeypatch.setenv("MOLORA_HYBRID_CACHE", str(tmp_path / "cache"))
    with pytest.raises(BundleError, match="pool_n=1"):
        read_bundle(_bundle(tmp_path, {**ROUTER, "pool_n": 1}))
    with pytest.raises(BundleError, match=r"unknown hybrid settings \['zor'\]"):
        read_bundle(_bundle(tmp_path, {**ROUTER, "zor": 3.0}))
    with pytest.raises(BundleError, match="prompt=true"):
        read_bundle(_bundle(tmp_path, {**ROUTER, "arrow": {**ROUTER["arrow"], "prompt": False}}))
    with pytest.raises(BundleError, match="none are loaded"):
        molora.load(_bundle(tmp_path, ROUTER, adapters=0))
    argv = ["serve", "--model", str(tmp_path / "base"), "--lora-modules", f"a={tmp_path / 'e0'}", "--router", "hybrid"]
    assert main([*argv, "--ray"]) != 0
    assert "--router hybrid is served without --ray" in capsys.readouterr().err
    assert main(["bundle", "init", *argv[1:-1], "hybird", "--out", str(tmp_path / "b2")]) != 0
    assert "give none, arrow, arrow-token, hybrid, or the folder" in capsys.readouterr().err


def test_the_served_setting_is_the_committed_validation_choice():
    from molora.routing.arrow import ArrowConfig
    from molora.routing.hybrid import HybridSettings
    from molora.userbundle import router_entry

    root = Path(__file__).resolve().parent.parent / "docs"
    chosen = json.loads((root / "datafree_hybrid_choice.json").read_text())["chosen"]
    pool = json.loads((root / "datafree_confidence_choice.json").read_text())["pool_command"]
    size = json.loads((root / "hybrid_pool_size_choice.json").read_text())
    s = HybridSettings.from_json(router_entry("hybrid"))
    a = s.arrow
    n_blocks = 30  # SmolLM2-135M's, where the choice was made: the default source block is 5/6 of the depth
    assert a.source_block is None and (5 * n_blocks) // 6 == chosen["block"] and a == ArrowConfig(**a.__dict__)
    assert (a.rms_threshold, a.prompt_window, a.prompt_share) == (
        chosen["threshold"],
        chosen["window"],
        chosen["prompt_share"],
    )
    assert (s.z_or, s.z_floor) == (chosen["z_or"], chosen["z_floor"])
    want = f"--seed {s.pool_seed} --batch {s.pool_batch} --max-new-tokens {s.pool_max_new_tokens} "
    assert want + f"--temperature {s.pool_temperature}" in pool  # the first pool_n turns of the validated pool
    assert s.pool_n == size["chosen"]["pool_n"] and size["joint_pass_check"]["picks_differ"] == 0


@pytest.mark.slow
@pytest.mark.real_model
def test_real_model_served_with_the_flags_picks_as_the_chooser_does_offline(tmp_path, monkeypatch):
    """SmolLM2-135M-Instruct (its dequantized cache folder) with two of the default bundle's adapters, served by
    `--model ... --lora-modules ... --router hybrid --chat-template` (ChatML without a system turn, as the default
    bundle's template), a small pool to keep it short: each pick equals the chooser's own offline, and the answer
    equals the answer pinned to that pick."""
    import openai

    from molora.bundle import DEFAULT_BUNDLE_DIR
    from molora.cli import build_parser, own_bundle
    from molora.model.base import DEFAULT_BASE_NAME, cache_root, load_default_base

    monkeypatch.setenv("MOLORA_HYBRID_CACHE", str(tmp_path / "cache"))
    load_default_base()  # writes the cache folder on first use
    folder = cache_root() / DEFAULT_BASE_NAME.rsplit("/", 1)[-1]
    chatml = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    chatml += "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    adapters = [f"{n}={DEFAULT_BUNDLE_DIR / 'adapters' / n}" for n in ("counting", "navigate")]
    args = build_parser().parse_args(
        ["serve", "--model", str(folder), "--lora-modules", *adapters, "--router", "hybrid", "--chat-template", chatml]
    )
    bundle = own_bundle(args)
    router = {**bundle.router_options, "pool_n": 24, "pool_batch": 24}
    bundle = dataclasses.replace(bundle, router_options=router)
    engine = build_engine(bundle, EngineConfig(max_model_len=512))
    questions = [
        "How many fruits do I have? I have an apple, two bananas, a plum and a violin.",
        "If you follow these instructions, do you return to the starting point? Take 3 steps. Turn around. "
        "Take 3 steps.",
        "Write a short greeting for a birthday card.",
    ]
    offline = engine.mm.chooser.choose_per_request(engine.mm, questions)
    with ServerThread(create_app(engine)) as url:
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        for q, pick in zip(questions, offline):
            msg = [{"role": "user", "content": q}]
            chat = client.chat.completions.create(model=str(folder), messages=msg, max_tokens=16, temperature=0)
            assert chat.choices[0].model_extra["molora"]["chooser"]["adapter"] == pick
            alone = {"model": pick} if pick else {"model": str(folder), "extra_body": {"molora": {"adapters": []}}}
            pinned = client.chat.completions.create(messages=msg, max_tokens=16, temperature=0, **alone)
            assert chat.choices[0].message.content == pinned.choices[0].message.content


def test_the_results_section_renders_the_served_records():
    from tests.conftest import load_script

    rec = json.loads((Path(__file__).resolve().parent.parent / "docs" / "hybrid_serve_cost.json").read_text())
    text = "\n".join(load_script("hybrid_serve_cost").render_section(rec))
    assert text.startswith("## Serving the hybrid data-free chooser (`--router hybrid`)")
    assert f"Median time ratio **{rec['median_time_ratio']:.3f}x**" in text and "Chosen: **400** turns" in text
    assert "the 800-turn row is identical to the committed choice's validation row" in text


def test_the_routing_evaluation_reads_its_goals_off_its_record():
    """experiments/routing_eval.py's page: a skill 10.5 points behind fails "within 10", the general and two-skill
    goals are read at their bounds (95% with none empty; sequence + 10 per turn)."""
    from tests.conftest import load_script

    def row(acc: float, vs: float) -> dict:
        return {"accuracy": acc, "vs_learned": vs, "vs_learned_ci95": [vs - 5, vs + 5]}

    def mixed(acc: float, vs: float) -> dict:
        return {"accuracy": acc, "item_accuracy": 0.0, "vs_sequence": vs, "vs_sequence_ci95": [vs - 5, vs + 5]}

    def general(ret: float, empty: float) -> dict:
        return {"retention": ret, "retention_ci95": [90.0, 100.0], "empty_where_base_answers": empty,
                "adapter_token_share": 0.0}  # fmt: skip

    rec = {
        "command": "python -m experiments.routing_eval --split test2",
        "date": "2026-12-04",
        "machine": {"cpu": "CPU", "threads": 2, "loadavg_end": [1.0, 1.0, 1.0]},
        "split": "test2",
        "fingerprint": "f",
        "hybrid_router": {"pool_n": 400},
        "n": 100,
        "n_general": 60,
        "n_mixed": 30,
        "skills": {
            "a": {"learned": row(90, 0), "hybrid": row(80, -10)},
            "b": {"learned": row(50, 0), "hybrid": row(49, -1)},
        },
        "general": {"learned": general(100, 0), "hybrid": general(95, 0)},
        "mixed": {"sequence": mixed(40, 0), "hybrid_turn": mixed(50, 10)},
    }
    render = load_script("routing_eval").render_section
    text = "\n".join(render(rec))
    assert "within 10 points of learned on every skill met (worst: a -10.0)" in text and "scored once" in text
    assert "general >= 95% met (95.0%, 0.0% empty)" in text and "sequence + 10 met (hybrid_turn +10.0)" in text
    rec["skills"]["b"]["hybrid"] = row(39.5, -10.5)
    rec["general"]["hybrid"] = general(100, 2.5)
    rec["mixed"]["hybrid_turn"] = mixed(49.9, 9.9)
    text = "\n".join(render(rec))
    assert "every skill not met (worst: b -10.5)" in text and "general >= 95% not met" in text
    assert "sequence + 10 not met (hybrid_turn +9.9)" in text and "| b | 50.0 | 39.5 | -10.5 [-15.5, -5.5] |" in text


def test_the_base_fingerprint_ignores_where_the_weights_were_read_from(served):
    """A GGUF's first load and later loads from its dequantized copy differ only in config._name_or_path: the
    calibration cache must hit on both."""
    from molora.calibration import base_fingerprint

    mm = molora.load(served)
    before = base_fingerprint(mm)
    mm.config._name_or_path = "/somewhere/else"
    assert base_fingerprint(mm) == before
    mm.config.vocab_size += 1  # what the model is still counts
    assert base_fingerprint(mm) != before


def test_routing_hybrid_in_the_engine_runs_each_request_pinned_to_the_choosers_pick(served):
    """Engine.add_request(routing="hybrid") is one submit: the request waits for the engine's chooser (one forward
    pass per step), then runs pinned to its pick, which its first output reports; the same tokens as the request
    pinned by hand. Aborting a request mid-choice unpins the chooser's adapters; a model without a chooser refuses
    the mode naming it."""
    from molora.config import SamplingParams
    from molora.engine import Engine, EngineConfig

    engine = Engine(molora.load(served), EngineConfig(max_num_seqs=4))
    picks = [c["adapter"] for c in engine.choose(list(PROMPTS[:4]))]
    assert None in picks and any(picks)  # the base and an adapter both picked: pinning is visible
    params = SamplingParams(max_new_tokens=4)
    prompts = [engine.tokenizer(q, add_special_tokens=False)["input_ids"] for q in PROMPTS[:4]]
    chosen = engine.generate(prompts, params, routing="hybrid", question=list(PROMPTS[:4]))
    assert [o.chosen["adapter"] for o in chosen] == picks
    pinned = engine.generate(prompts, params, adapter=picks, routing=["auto" if p else "none" for p in picks])
    assert [o.new_token_ids for o in chosen] == [o.new_token_ids for o in pinned]
    assert all(set(o.token_adapters) <= {p} for o, p in zip(chosen, picks))
    engine.check()
    rid = engine.add_request(prompts[0], params)  # a busy engine: the choice takes one pass per step
    gone = engine.add_request(prompts[1], params, routing="hybrid", question=PROMPTS[1])
    engine.step()
    assert any(engine.hotset.pins.values())
    engine.abort(gone)
    engine.abort(rid)
    engine.step()
    engine.check()
    assert not any(engine.hotset.pins.values()) and not engine.has_unfinished()
    plain = Engine(molora.load(served, chooser=False), ENGINE)  # the same bundle, its chooser left out
    with pytest.raises(RoutingError, match="per-request chooser") as e:
        plain.add_request(prompts[0], params, routing="hybrid")
    assert e.value.field == "mode" and not plain.has_unfinished()
