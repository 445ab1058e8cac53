"""Your own model and adapters, as a vLLM user brings them: a transformers folder, PEFT folders made by PEFT, the
serve flags (`--model`, `--lora-modules`, `--router`, ...), vLLM's adapter endpoints, the openai client.

Every model and adapter here draws its weights from its own `torch.Generator`, never the process RNG.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import torch

from molora.cli import build_parser, main, own_bundle
from molora.engine import EngineConfig
from molora.server.app import create_app
from molora.server.launch import ServerThread, build_engine
from molora.userbundle import FlagError

VOCAB = 128
CHAT = "{% for m in messages %}w5 {{ m['content'] }} w6 {% endfor %}{% if add_generation_prompt %}w7{% endif %}"
ENGINE = EngineConfig(max_num_seqs=8, max_model_len=128, kv_budget_tokens=2048)


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<|im_end|>": 1, "<s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", bos_token="<s>", unk_token="<pad>"
    )
    fast.chat_template = CHAT
    return fast


def _seeded_(module: torch.nn.Module, seed: int, std: float) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)


def _base(folder: Path) -> Path:
    """A tiny random Qwen3 saved as a transformers folder with a chat template in its tokenizer."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _seeded_(model, 1234, 0.08)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
    model.save_pretrained(str(folder))
    _tokenizer().save_pretrained(str(folder))
    return folder


def _peft_adapter(base: Path, out: Path, seed: int, targets: tuple[str, ...]) -> Path:
    """A PEFT LoRA made by PEFT itself on `base`, its A and B drawn from `seed`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    peft = get_peft_model(
        model,
        LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), init_lora_weights=False, task_type="CAUSAL_LM"),
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    peft.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def own(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("own")
    base = _base(root / "my-qwen3")
    adapters = root / "adapters"
    return {
        "base": base,
        "root": adapters,
        "a": _peft_adapter(base, adapters / "a", 1, ("q_proj", "v_proj")),
        "b": _peft_adapter(base, adapters / "b", 2, ("q_proj", "k_proj", "v_proj", "gate_proj")),
        "c": _peft_adapter(base, adapters / "c", 3, ("o_proj", "down_proj")),
    }


def _peft_greedy(own: dict[str, Path], adapter: str | None, ids: list[int], n: int) -> list[int]:
    """What PEFT's own generate answers (greedy, stopping at eos as the server does)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(own["base"]), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(own[adapter]))
    model.eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, eos_token_id=1, pad_token_id=0
        )
    new = out[0, len(ids) :].tolist()
    return new[: new.index(1)] if 1 in new else new


def _words(ids: list[int]) -> str:
    """The text of ids as the server returns it (special tokens 0-2 skipped)."""
    return " ".join(f"w{i}" for i in ids if i > 2)


def _serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def _app(own: dict[str, Path], *argv: str, **kwargs):
    bundle = own_bundle(_serve_args("--model", str(own["base"]), *argv))
    return create_app(build_engine(bundle, ENGINE), **kwargs)


def test_pinned_outputs_equal_peft_through_the_openai_client(own):
    import openai

    app = _app(
        own,
        "--lora-modules",
        f"a={own['a']}",
        json.dumps({"name": "b", "path": str(own["b"])}),
        "--max-loras",
        "3",
        "--served-model-name",
        "my-model",
    )
    prompt = [10, 11, 12, 13]
    with ServerThread(app) as url:
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        listed = {m.id: (m.model_extra.get("parent"), m.model_extra.get("root")) for m in client.models.list()}
        assert listed == {
            "my-model": (None, "my-model"),
            "a": ("my-model", str(own["a"].resolve())),
            "b": ("my-model", str(own["b"].resolve())),
        }
        for model, adapter in (("a", "a"), ("b", "b"), ("my-model", None), ("my-model:b", "b")):
            got = client.completions.create(model=model, prompt=_words(prompt), max_tokens=10, temperature=0)
            assert got.choices[0].text.split() == _words(_peft_greedy(own, adapter, prompt, 10)).split(), model
        chat = client.chat.completions.create(
            model="b", messages=[{"role": "user", "content": "w20 w21 w22"}], max_tokens=8, temperature=0
        )
        templated = [5, 20, 21, 22, 6, 7]  # the tokenizer's own chat template: w5 {content} w6 w7
        assert chat.choices[0].message.content.split() == _words(_peft_greedy(own, "b", templated, 8)).split()
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.completions.create(model="nope", prompt="w3", max_tokens=2)


def test_vllm_adapter_endpoints_load_and_unload(own):
    app = _app(
        own, "--lora-modules", f"a={own['a']}", admin_keys=["admin"], api_keys=["user"], adapter_roots=[own["root"]]
    )
    admin = {"Authorization": "Bearer admin"}
    prompt = [30, 31, 32]
    with ServerThread(app) as url, httpx.Client(base_url=url.removesuffix("/v1"), timeout=60) as http:

        def complete(model: str) -> httpx.Response:
            return http.post(
                "/v1/completions",
                headers={"Authorization": "Bearer user"},
                json={"model": model, "prompt": _words(prompt), "max_tokens": 6, "temperature": 0},
            )

        body = {"lora_name": "c", "lora_path": str(own["c"])}
        assert (
            http.post("/v1/load_lora_adapter", json=body, headers={"Authorization": "Bearer user"}).status_code == 403
        )
        bad = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/etc"}, headers=admin)
        assert bad.status_code == 403 and "adapter roots" in bad.json()["error"]["message"]
        assert (
            http.post(
                "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "nowhere"}, headers=admin
            ).status_code
            == 404
        )
        r = http.post("/v1/load_lora_adapter", json=body, headers=admin)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'c' added successfully."
        assert http.post("/v1/load_lora_adapter", json=body, headers=admin).status_code == 409
        cards = http.get("/v1/models", headers=admin).json()["data"]
        assert {c["id"]: c["parent"] for c in cards} == {
            str(own["base"]): None,
            "a": str(own["base"]),
            "c": str(own["base"]),
        }
        # c targets o_proj and down_proj, which the served adapters do not: the bank holds every projection
        assert complete("c").json()["choices"][0]["text"].split() == _words(_peft_greedy(own, "c", prompt, 6)).split()
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "c"}, headers=admin)
        assert r.status_code == 200 and "removed" in r.text
        assert complete("c").status_code == 404
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "c"}, headers=admin).status_code == 404
        assert complete("a").json()["choices"][0]["text"].split() == _words(_peft_greedy(own, "a", prompt, 6)).split()


def test_router_arrow_routes_the_base_name_by_prompt_level_arrow(own):
    bundle = own_bundle(
        _serve_args(
            "--model", str(own["base"]), "--lora-modules", f"a={own['a']}", f"b={own['b']}", "--router", "arrow"
        )
    )
    engine = build_engine(bundle, ENGINE)
    router = engine.mm.router
    assert router.config.prompt and router.probe_prompt and router._moments  # calibrated on general text at start
    app = create_app(engine)
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        r = http.post(
            "/completions",
            json={
                "model": str(own["base"]),
                "prompt": "w40 w41 w42 w43",
                "max_tokens": 8,
                "molora": {"return_routing": True},
                "ignore_eos": True,
            },
        ).json()
        adapters = r["choices"][0]["molora"]["adapters"]
        # prompt-level Arrow: the answer carries the prompt's one decision (an adapter, or the base model)
        assert len(adapters) == 8 and len(set(adapters)) == 1 and set(adapters) <= {"a", "b", None}


def test_router_gates_folder_serves_the_base_name_by_per_adapter_gates(own, tmp_path):
    from molora.routing.gates import Gate, GateConfig, GateRouter

    hidden = json.loads((Path(own["base"]) / "config.json").read_text())["hidden_size"]
    g = torch.Generator().manual_seed(0)
    gates = {n: Gate(torch.randn(hidden, generator=g), 0.0, -100.0) for n in ("a", "b")}  # every token claimed
    GateRouter(GateConfig(hidden_size=hidden, source_block=-1), gates).save(tmp_path / "gates")
    argv = ("--model", str(own["base"]), "--lora-modules", f"a={own['a']}", f"b={own['b']}")
    engine = build_engine(own_bundle(_serve_args(*argv, "--router", str(tmp_path / "gates"))), ENGINE)
    assert isinstance(engine.mm.router, GateRouter) and engine.mm.router.adapter_names == ["a", "b"]
    with ServerThread(create_app(engine)) as url, httpx.Client(base_url=url, timeout=60) as http:
        body = {"model": str(own["base"]), "prompt": "w40 w41 w42 w43", "max_tokens": 8, "ignore_eos": True}
        r = http.post("/completions", json={**body, "molora": {"return_routing": True}}).json()
        adapters = r["choices"][0]["molora"]["adapters"]
        assert len(adapters) == 8 and len(set(adapters)) == 1 and set(adapters) <= {"a", "b"}  # the prompt's one gate


def test_bundle_init_train_router_then_serve_it(own, tmp_path):
    bundle = tmp_path / "bundle"
    assert (
        main(
            [
                "bundle",
                "init",
                "--model",
                str(own["base"]),
                "--lora-modules",
                f"a={own['a']}",
                f"b={own['b']}",
                "--out",
                str(bundle),
            ]
        )
        == 0
    )
    assert main(["bundle", "check", str(bundle)]) == 0
    data = {}
    for name, words in (("a", range(10, 40)), ("b", range(60, 90))):
        path = tmp_path / f"{name}.jsonl"
        rows = [
            {"prompt": _words(list(words)[i : i + 5]), "completion": _words(list(words)[i + 5 : i + 8])}
            for i in range(0, 20)
        ]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        data[name] = path
    assert (
        main(
            [
                "train-router",
                "--bundle",
                str(bundle),
                "--data",
                f"a={data['a']}",
                "--data",
                f"b={data['b']}",
                "--limit",
                "20",
            ]
        )
        == 0
    )
    app = _app(own, "--lora-modules", f"a={own['a']}", f"b={own['b']}", "--router", str(bundle / "router"))
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        r = http.post(
            "/chat/completions",
            json={
                "model": str(own["base"]),
                "max_tokens": 6,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": "w12 w13 w14"}],
                "molora": {"return_routing": True},
            },
        )
        assert r.status_code == 200
        assert len(r.json()["choices"][0]["molora"]["adapters"]) == 6
    assert main(["bundle", "check", str(bundle)]) == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lora-modules", "a"], "--lora-modules 'a': write NAME=PATH"),
        (["--lora-modules", "a=/no/such/folder"], "/no/such/folder"),
        (["--lora-modules", '{"name": "a"}'], 'needs string fields "name" and "path"'),
        (["--router", "/no/such/router"], "--router '/no/such/router'"),
        (["--chat-template", "not a template"], "--chat-template 'not a template'"),
    ],
)
def test_bad_flags_name_the_flag_and_value(own, argv, message):
    with pytest.raises(FlagError) as e:
        own_bundle(_serve_args("--model", str(own["base"]), *argv))
    assert message in str(e.value)


def test_bad_adapter_folders_stop_start_up_with_their_path(own, tmp_path, capsys):
    ia3 = tmp_path / "ia3"
    ia3.mkdir()
    (ia3 / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3", "target_modules": ["q_proj"]}))
    argv = ["serve", "--model", str(own["base"]), "--lora-modules", f"a={own['a']}", f"bad={ia3}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--lora-modules bad=" in err and str(ia3) in err and "IA3" in err
    assert (
        main(
            [
                "serve",
                "--model",
                str(own["base"]),
                "--lora-modules",
                f"a={own['a']}",
                f"b={own['b']}",
                "--max-loras",
                "1",
            ]
        )
        == 2
    )
    assert "--max-loras 1 is fewer than the 2" in capsys.readouterr().err
    assert main(["serve", "--lora-modules", f"a={own['a']}"]) == 2
    assert "need --model" in capsys.readouterr().err
    assert main(["serve", "--model", str(tmp_path / "missing-model")]) == 2
    assert "missing-model" in capsys.readouterr().err
    from transformers import GPT2Config

    GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2).save_pretrained(str(tmp_path / "gpt2"))
    assert main(["serve", "--model", str(tmp_path / "gpt2")]) == 2
    assert "a 'gpt2' model; molora's engine serves llama, mistral, qwen2, qwen3" in capsys.readouterr().err


def test_bundle_check_names_each_broken_file_and_the_flags_manifest_round_trips(own, tmp_path):
    from molora.bundle import read_bundle
    from molora.userbundle import check_bundle, write_bundle

    flags = own_bundle(
        _serve_args(
            "--model",
            str(own["base"]),
            "--lora-modules",
            f"a={own['a']}",
            f"b={own['b']}",
            "--router",
            "arrow",
            "--max-loras",
            "5",
        )
    )
    written = read_bundle(write_bundle(tmp_path / "ok", flags.manifest).parent)  # what --ray serves from
    assert (written.base, written.adapters, written.router_kind, written.slots) == (
        flags.base,
        flags.adapters,
        flags.router_kind,
        5,
    )
    assert check_bundle(tmp_path / "ok") == []
    with pytest.raises(FlagError, match="exists already"):
        write_bundle(tmp_path / "ok", flags.manifest)

    import shutil

    broken = tmp_path / "broken"
    for name in ("a", "b"):
        shutil.copytree(own[name], broken / name)
    (broken / "a" / "adapter_model.safetensors").unlink()
    cfg = json.loads((broken / "b" / "adapter_config.json").read_text())
    cfg["r"] = 32  # the weights say 4
    (broken / "b" / "adapter_config.json").write_text(json.dumps(cfg))
    manifest = {
        **flags.manifest,
        "router": {"kind": "none"},
        "adapters": [{"name": "a", "path": "a"}, {"name": "b", "path": "b"}],
    }
    (broken / "molora.json").write_text(json.dumps(manifest))
    problems = check_bundle(broken)
    assert len(problems) == 2
    assert str(broken / "a") in problems[0] and "adapter_model.safetensors" in problems[0]
    assert str(broken / "b") in problems[1] and "r=32" in problems[1]
    assert main(["bundle", "check", str(broken)]) == 1


@pytest.mark.slow
@pytest.mark.real_model
def test_real_model_folder_with_a_default_adapter_equals_peft(tmp_path):
    """SmolLM2-135M-Instruct as a plain transformers folder (the dequantized cache) with one of the default bundle's
    PEFT adapters, served with vLLM's flags: the pinned answer equals PEFT's generate, token for token."""
    import openai
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from molora.bundle import DEFAULT_BUNDLE_DIR
    from molora.model.base import DEFAULT_BASE_NAME, cache_root, load_default_base

    load_default_base()  # writes the cache folder on first use
    folder = cache_root() / DEFAULT_BASE_NAME.rsplit("/", 1)[-1]
    adapter = DEFAULT_BUNDLE_DIR / "adapters" / "arithmetic"
    question = "((3 + -2) * (4 - 1)) ="
    tok = AutoTokenizer.from_pretrained(str(folder))
    ids = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32), str(adapter)
    ).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
        )
    expected = tok.decode(out[0, len(ids) :], skip_special_tokens=True)
    app = create_app(
        build_engine(
            own_bundle(_serve_args("--model", str(folder), "--lora-modules", f"arith={adapter}")),
            ENGINE.__class__(max_model_len=512),
        )
    )
    with ServerThread(app) as url:
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        chat = client.chat.completions.create(
            model="arith", messages=[{"role": "user", "content": question}], max_tokens=24, temperature=0
        )
    assert chat.choices[0].message.content == expected


def test_lora_resolver_dir_loads_an_adapter_on_first_use(own):
    import openai

    app = _app(own, "--lora-modules", f"a={own['a']}", lora_resolver_dirs=[own["root"]])
    prompt = [50, 51, 52]
    with ServerThread(app) as url:
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        assert {m.id for m in client.models.list()} == {str(own["base"]), "a"}  # nothing read before it is named
        got = client.completions.create(model="c", prompt=_words(prompt), max_tokens=6, temperature=0)
        assert got.choices[0].text.split() == _words(_peft_greedy(own, "c", prompt, 6)).split()
        assert {m.id for m in client.models.list()} == {str(own["base"]), "a", "c"}
        for unknown in ("nope", "..", "../adapters/b"):
            with pytest.raises(openai.NotFoundError):
                client.completions.create(model=unknown, prompt="w3", max_tokens=2)

        async def many():  # four requests name b at once: one load, four answers
            async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as c:
                return await asyncio.gather(
                    *(
                        c.completions.create(model="b", prompt=_words(prompt), max_tokens=6, temperature=0)
                        for _ in range(4)
                    )
                )

        texts = {r.choices[0].text for r in asyncio.run(many())}
        assert [t.split() for t in texts] == [_words(_peft_greedy(own, "b", prompt, 6)).split()]


def test_prefix_caching_flag_follows_vllm():
    assert _serve_args().enable_prefix_caching is True
    assert _serve_args("--no-enable-prefix-caching").enable_prefix_caching is False


def test_vllm_capacity_flags_size_the_slots_rank_and_cpu_tier(own):
    bundle = own_bundle(
        _serve_args(
            "--model", str(own["base"]), "--lora-modules", f"a={own['a']}", "--max-loras", "3", "--max-lora-rank", "16"
        )
    )
    engine = build_engine(bundle, ENGINE, max_cpu_loras=2)
    try:
        bank = engine.mm.bank
        assert (bank.num_slots, bank.config.max_rank) == (3, 16)
        assert engine.hotset.cpu_budget == 2 * bank.slot_nbytes() > 0
    finally:
        engine.close()
    with pytest.raises(FlagError, match="rank 4 is over --max-lora-rank 2"):
        own_bundle(_serve_args("--model", str(own["base"]), "--lora-modules", f"a={own['a']}", "--max-lora-rank", "2"))
