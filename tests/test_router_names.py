"""A router name means one router everywhere: `molora route`, `molora generate`, `molora eval` and the server's
`molora.routing` give the same prompt the same per-token adapters and the same answer under `arrow`, `arrow-token`
and `hybrid` (molora.routing.names), whether the bundle's own router is that one or another kind.

Tiny random Llama bases (for hybrid one that ends a turn often, so its chooser's pool fills) and two PEFT adapters,
each drawn from its own generator."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import httpx
import pytest

from molora.cli import main
from molora.engine import EngineConfig
from molora.routing.names import ARROW_ROUTER, ARROW_TOKEN_ROUTER, HYBRID_ROUTER, NAMED_ROUTERS, router_config
from molora.server.app import create_app
from molora.server.launch import ServerThread, build_engine
from tests.conftest import make_peft_adapter, save_eos_prone_base, tiny_model, tiny_tokenizer

TEMPLATE = "w3 {prompt} w4"
ENGINE = EngineConfig(max_num_seqs=4, max_model_len=128, kv_budget_tokens=1024)
PROMPTS = ["w40 w41 w42 w43 w44", "w90 w17 w23 w8 w61 w5", "w12 w12 w77"]
MAX = 8
# the named settings, with the hybrid's pool cut to what a test can write quickly (its own kind: it wins by name)
HYBRID = {**HYBRID_ROUTER, "pool_n": 24, "pool_batch": 24, "pool_max_new_tokens": 6}
OWN_ARROW = {**ARROW_ROUTER, "rms_threshold": 0.8, "prompt_share": 0.1}  # a bundle's own Arrow, claiming more


def _bundle(root: Path, name: str, router: dict) -> Path:
    from molora.bundle import write_manifest

    base = root / ("base-eos" if router.get("kind") == "hybrid" or name.endswith("hybrid") else "base")
    if not base.exists() and base.name == "base-eos":
        save_eos_prone_base(base)
    elif not base.exists():
        tiny_model("llama").save_pretrained(str(base))
        tiny_tokenizer().save_pretrained(str(base))
    entries = []
    for i in range(2):
        path = root / f"e{i}"
        if not path.exists():
            make_peft_adapter(path, "llama", seed=10 + i)
        entries.append({"name": f"e{i}", "path": str(path)})
    folder = root / name
    folder.mkdir()
    manifest = {"name": "d", "base": str(base), "adapters": entries, "prompt_template": TEMPLATE}
    write_manifest(folder, {**manifest, "stop": ["<|im_end|>"], "router": router})
    return folder


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("names")
    mp = pytest.MonkeyPatch()
    mp.setenv("MOLORA_HYBRID_CACHE", str(root / "cache"))
    out = {"none": _bundle(root, "none", {"kind": "none"})}
    named = (("arrow", ARROW_ROUTER), ("arrow-token", ARROW_TOKEN_ROUTER), ("hybrid", HYBRID), ("own", OWN_ARROW))
    for name, router in named:
        out[name] = _bundle(root, name, router)
    yield out
    mp.undo()


def _cli(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(argv)) == 0
    return out.getvalue()


def _route(bundle: Path, name: str, prompt: str) -> tuple[str, list]:
    """(answer text, per answer token the adapter of the forward that produced it) from `molora route --json`, which
    prints each token's own adapter: the producer of answer token i is the token before it (the last prompt token,
    "w4" of the template, for the first). This is what the server's return_routing reports per generated token."""
    router = ("--router", name) if name != "bundle" else ()
    view = json.loads(_cli("route", prompt, "--bundle", str(bundle), *router, "--max-tokens", str(MAX), "--json"))
    tokens = view["tokens"]
    first = next(i for i, t in enumerate(tokens) if t["answer"]) if any(t["answer"] for t in tokens) else len(tokens)
    answer = tokens[first:]
    producers = tokens[first - 1 : first - 1 + len(answer)]
    return "".join(t["text"] for t in answer).strip(), [t["adapter"] for t in producers]


def _served(bundle: Path, routing: str, prompts: list[str]) -> list[tuple[str, list, int]]:
    """Per prompt (answer text, per visible answer token its adapter, status) from the server's chat endpoint."""
    engine = build_engine(bundle, ENGINE)
    special = set(engine.mm.tokenizer.all_special_ids)
    out = []
    with ServerThread(create_app(engine)) as url, httpx.Client(base_url=url, timeout=120) as http:
        for prompt in prompts:
            body = {
                "model": "d",
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": MAX,
                "temperature": 0,
                "molora": {"routing": routing, "return_routing": True},
            }
            r = http.post("/chat/completions", json=body)
            if r.status_code != 200:
                out.append(("", [], r.status_code))
                continue
            choice = r.json()["choices"][0]
            routed = choice["molora"]
            adapters = [a for t, a in zip(routed["token_ids"], routed["adapters"]) if t not in special]
            out.append((choice["message"]["content"].strip(), adapters, 200))
    return out


def _evaluated(bundle: Path, name: str, prompts: list[str], tmp: Path) -> list[dict]:
    task = tmp / "general.jsonl"
    task.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    preds = tmp / f"pred-{name}.jsonl"
    argv = ("eval", "--bundle", str(bundle), "--task", f"general:{task}", "--routing", name)
    _cli(*argv, "--max-tokens", str(MAX), "--batch-size", "1", "--predictions", str(preds))
    return [json.loads(line) for line in preds.read_text().splitlines()]


def test_one_place_maps_a_name_and_a_bundles_own_settings_win():
    assert set(NAMED_ROUTERS) == {"arrow", "arrow-token", "hybrid"}
    assert router_config("arrow") == ARROW_ROUTER and router_config("arrow", {"kind": "learned"}) == ARROW_ROUTER
    own = {"kind": "arrow", "granularity": "per_block", "threshold": 0.3}
    assert router_config("arrow", own) == own  # the bundle's own Arrow is what `arrow` means on it
    assert router_config("arrow-token", own) == ARROW_TOKEN_ROUTER  # a name of its own: always the plain defaults
    assert router_config("hybrid", {"kind": "none"}) == HYBRID_ROUTER
    from molora.userbundle import router_entry

    assert all(router_entry(n) == router_config(n) for n in NAMED_ROUTERS)  # serve --router NAME writes the same


@pytest.mark.parametrize("name", ["arrow", "arrow-token", "hybrid"])
def test_route_generate_eval_and_serve_agree_per_token(bundles, name, tmp_path):
    own = bundles[name]  # a bundle whose own router is the named one (what `serve --router NAME` writes)
    other = bundles["none"]  # a bundle with another router: the name builds the same router
    if name == "hybrid":  # the name's pool settings on the other bundle: the test's smaller pool
        other = _bundle(tmp_path, "none-hybrid", {"kind": "none"})
        import molora.routing.names as names

        mp = pytest.MonkeyPatch()
        mp.setitem(names.NAMED_ROUTERS, "hybrid", HYBRID)
    else:
        mp = None
    try:
        routed = [_route(other, name, p) for p in PROMPTS]
        assert routed == [_route(own, name, p) for p in PROMPTS]  # the name on either bundle
        assert routed == [_route(own, "bundle", p) for p in PROMPTS]  # the bundle's own router
        generated = [
            _cli("generate", p, "--bundle", str(other), "--router", name, "--max-tokens", str(MAX)) for p in PROMPTS
        ]
        assert [g.strip() for g in generated] == [text for text, _ in routed]
        evaluated = _evaluated(other, name, PROMPTS, tmp_path)
        assert [e["prediction"].strip() for e in evaluated] == [text for text, _ in routed]
        assert [e["adapter_tokens"] > 0 for e in evaluated] == [any(a is not None for a in ads) for _, ads in routed]
    finally:
        if mp is not None:
            mp.undo()
    served = _served(own, name, PROMPTS)
    assert [text for text, _, _ in served] == [text for text, _ in routed]  # molora.routing NAME: the same answer
    if name != "arrow-token":  # per-linear routing has no one adapter per token that the server reports
        assert [ads for _, ads, _ in served] == [ads for _, ads in routed]  # and the same adapter per token
    assert any(a is not None for _, ads in routed for a in ads)  # the comparison sees adapters, not only the base
    if name != "arrow-token":  # a prompt-level decision: some prompt keeps the base model (or ends at once)
        assert any(all(a is None for a in ads) for _, ads in routed)
    if name == "arrow-token":  # per token with no base option: every answer token comes from an adapter
        assert all(a is not None for _, ads in routed for a in ads)


@pytest.mark.parametrize("name", ["arrow", "arrow-token", "hybrid"])
def test_a_server_without_that_router_refuses_the_name(bundles, name):
    (_, _, status), *_ = _served(bundles["none"], name, PROMPTS[:1])
    assert status == 400


def test_a_bundles_own_arrow_settings_win_in_every_command(bundles, tmp_path):
    own = [_route(bundles["own"], "arrow", p) for p in PROMPTS]
    assert own == [_route(bundles["own"], "bundle", p) for p in PROMPTS]  # its own router is what `arrow` means
    assert own != [_route(bundles["none"], "arrow", p) for p in PROMPTS]  # not the named settings it replaced
    assert [e["prediction"].strip() for e in _evaluated(bundles["own"], "arrow", PROMPTS, tmp_path)] == [
        t for t, _ in own
    ]
    assert [(t, a) for t, a, _ in _served(bundles["own"], "arrow", PROMPTS)] == own
    assert any(a is not None for _, ads in own for a in ads)  # the comparison sees adapters, not only the base
