"""Vocabulary routing on an early-fusion text+image model: the mechanics on an untrained tiny model (seconds),
and the shipped, trained digits bundle (slow)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from molora.adapters.io import save_adapter
from molora.bundle import load, read_bundle, write_manifest
from molora.errors import RoutingError
from molora.multimodal import generate as mg
from molora.multimodal.base import tiny_config
from molora.multimodal.recipe import ROUTES
from molora.multimodal.vocab import BOI, CODES, PIXELS, build_tokenizer, caption, parse_caption, quantise
from molora.routing import VocabRouter
from molora.routing.base import id_ranges
from tests.conftest import load_script, random_model

pytest.importorskip("sklearn")


def _adapter(path, shapes, seed, rank=4):
    g = torch.Generator().manual_seed(seed)
    mods = {
        m: (torch.randn(rank, d_in, generator=g) * 0.3, torch.randn(d_out, rank, generator=g) * 0.3)
        for m, (d_out, d_in) in shapes.items()
    }
    save_adapter(path, mods, r=rank, lora_alpha=8.0, base_model_name_or_path="base")


@pytest.fixture(scope="module")
def tiny_bundle(tmp_path_factory):
    """An untrained tiny early-fusion base with two random adapters, served as a vocab-routed bundle."""
    from transformers import LlamaForCausalLM

    folder = tmp_path_factory.mktemp("digits")
    model = random_model(tiny_config(hidden=32, layers=2, heads=2, ffn=64), seed=0, cls=LlamaForCausalLM)
    model.save_pretrained(str(folder / "base"))
    build_tokenizer().save_pretrained(str(folder / "base"))
    shapes = {
        n: (m.out_features, m.in_features)
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n.endswith(("q_proj", "v_proj", "up_proj", "down_proj"))
    }
    for i, name in enumerate(("image", "text")):
        _adapter(folder / "adapters" / name, shapes, seed=i)
    write_manifest(
        folder,
        {
            "name": "tiny-digits",
            "base": "base",
            "prompt_template": "<bos> {prompt}",
            "stop": ["<eos>"],
            "router": {"kind": "vocab"},
            "vocab_routes": ROUTES,
            "adapters": [{"name": n, "path": f"adapters/{n}"} for n in ("image", "text")],
        },
    )
    return folder


@pytest.fixture(scope="module")
def mm(tiny_bundle):
    return load(tiny_bundle)


# --------------------------------------------------------------------------------------------- vocabulary


def test_tokenizer_is_a_plain_transformers_tokenizer_with_image_tokens(tiny_bundle):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_bundle / "base"))
    text = f"<bos> draw the digit 7 {BOI} {CODES[0]} {CODES[15]} <eoi> this is the digit 7 <eos>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 15 and len(tok) == 46
    assert tok.decode(ids, skip_special_tokens=True) == text.replace("<bos> ", "").replace(" <eos>", "")


def test_caption_parsing_names_digit_style_or_broken():
    assert parse_caption(caption(7)) == (7, "base")
    assert parse_caption(caption(3, "new")) == (3, "new")
    assert parse_caption("this is the digit seven") == (None, None)
    assert parse_caption("the digit is") == (None, None)
    assert quantise(np.array([0, 8, 16])).tolist() == [0, 7, 15]


# --------------------------------------------------------------------------------------------- routing


def test_vocab_router_ranges_come_from_the_tokenizer(mm):
    router = mm.router
    vocab = mm.tokenizer.get_vocab()
    assert router.ranges == [(vocab[BOI], vocab[CODES[-1]] + 1, "image")] and router.default == "text"


def test_off_by_one_rule_boi_routes_to_image_and_eoi_to_text(mm):
    """The input token decides: <boi> predicts the first code (image adapter), <eoi> the first caption word."""
    tok = mm.tokenizer
    ids = tok(
        f"<bos> draw {BOI} {CODES[3]} {CODES[4]} <eoi> this <eos>", add_special_tokens=False, return_tensors="pt"
    )["input_ids"]
    names = [mm.adapter_names[i] for i in mm.router.route(ids, mm.adapter_names).adapter_ids[0].tolist()]
    assert names == ["text", "text", "image", "image", "image", "text", "text", "text"]


def test_id_ranges_merges_runs():
    assert id_ranges([3, 4, 5, 9, 11, 12]) == [(3, 6), (9, 10), (11, 13)]
    assert id_ranges([]) == []


def test_vocab_router_from_vocab_refuses_a_prefix_that_matches_nothing():
    with pytest.raises(RoutingError, match="starts with"):
        VocabRouter.from_vocab({"a": 0, "b": 1}, {"image": ["IMGIMG"]})


def _tiny_text_config():
    return dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)


def test_chameleon_vocabulary_map_gives_several_ranges():
    """Chameleon places its image tokens by a lookup table (names IMGIMG...), not contiguous: several ranges,
    the same ids as transformers' own ChameleonImageVocabularyMapping."""
    transformers = pytest.importorskip("transformers")
    vm = {"<s>": 0, "a": 1, "IMGIMGBA": 2, "IMGIMGBB": 3, "b": 4, "IMGIMGBC": 5, "<image>": 6, "IMGIMGBD": 7}
    vq = dict(
        embed_dim=4,
        num_embeddings=8,
        base_channels=32,
        channel_multiplier=[1],
        num_res_blocks=1,
        latent_channels=4,
        resolution=8,
        in_channels=3,
    )
    try:
        cfg = transformers.ChameleonConfig(vocab_size=8, vocabulary_map=vm, vq_config=vq, **_tiny_text_config())
        model = transformers.ChameleonForConditionalGeneration(cfg)
    except Exception as e:  # noqa: BLE001 - a transformers version that cannot build it offline
        pytest.skip(f"cannot build a tiny Chameleon here: {e}")
    router = VocabRouter.from_vocab(model.config.vocabulary_map, {"image": ["IMGIMG"]}, "text")
    assert router.ranges == [(2, 4, "image"), (5, 6, "image"), (7, 8, "image")]
    ids = torch.arange(8)[None]
    routed = router.route(ids, ["image", "text"]).adapter_ids[0]
    expected = torch.tensor([0 if i in model.model.vocabulary_mapping.image_tokens else 1 for i in range(8)])
    assert torch.equal(routed, expected)


def test_emu3_visual_tokens_fill_one_top_range():
    transformers = pytest.importorskip("transformers")
    names = ["<|endoftext|>", "a", "b", "<|image start|>"] + [f"<|visual token {i:06d}|>" for i in range(6)]
    vm = {n: i for i, n in enumerate(names)}
    try:
        cfg = transformers.Emu3Config(vocabulary_map=vm, text_config=dict(vocab_size=len(vm), **_tiny_text_config()))
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"cannot build an Emu3 config here: {e}")
    router = VocabRouter.from_vocab(cfg.vocabulary_map, {"image": ["<|visual token"]}, "text")
    assert router.ranges == [(4, 10, "image")]


# --------------------------------------------------------------------------------------------- generation


def test_constrained_draw_emits_exactly_one_64_code_image_then_words(mm):
    for spec in (None, "image", mm.router, mg.EveryToken(["image", "text"])):
        for d in mg.draw(mm, [1, 7], spec, temperature=1.0, seed=3):
            assert d.image is not None and d.image.shape == (PIXELS,)
            assert all(w not in d.caption for w in ("<img_", BOI, "<eoi>"))


def test_one_routed_pass_equals_one_pass_per_adapter(mm):
    """K passes (each adapter over every row, the router's pick kept) give the same tokens as one routed pass."""
    one = mg.draw(mm, [0, 4, 9], mm.router, temperature=1.0, seed=11)
    k = mg.draw(mm, [0, 4, 9], mm.router, temperature=1.0, seed=11, passes=["image", "text"])
    assert [d.tokens for d in one] == [d.tokens for d in k]


def test_routed_generation_uses_each_adapter_on_its_own_tokens(mm):
    """Vocab routing equals an oracle that pins image tokens to the image adapter and the rest to text."""
    from molora.routing import OracleRouter

    prompt = mg.encode(mm, f"draw the digit 2 {BOI}")
    routed = mg.draw(mm, [2], mm.router)[0].tokens
    ids = torch.tensor([prompt + routed])
    labels = [["image" if t in range(29, 46) else "text" for t in ids[0].tolist()]]
    a = mm(ids, adapter_ids=mm.router).logits
    b = mm(ids, adapter_ids=OracleRouter(labels)).logits
    assert torch.allclose(a, b, atol=1e-5)
    assert not torch.allclose(a, mm(ids, adapter_ids="text").logits, atol=1e-3)


def test_captioning_answers_in_words(mm):
    caps = mg.caption_images(mm, [np.zeros(PIXELS, dtype=np.int64)], mm.router, temperature=1.0, seed=0)
    assert caps and "<img_" not in caps[0]


def test_png_from_generated_text(tmp_path, mm):
    d = mg.draw(mm, [5], mm.router, temperature=1.0, seed=0)[0]
    text = mm.tokenizer.decode(mg.encode(mm, f"draw the digit 5 {BOI}") + d.tokens, skip_special_tokens=True)
    levels = mg.levels_from_text(text)
    assert np.array_equal(levels, d.image)
    path = mg.write_png(mg.to_pixels(levels, scale=4), tmp_path / "x.png")
    raw = path.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(raw[16:20], "big") == 32


def test_bundle_serves_through_generate_and_the_engine(tiny_bundle, mm):
    """`molora generate` and the engine run the bundle like any other: the engine's greedy tokens equal
    MoLoRAModel.generate's under the same vocab router."""
    from molora.bundle import run_prompt
    from molora.config import SamplingParams
    from molora.engine import Engine, EngineConfig

    res = run_prompt(mm, f"draw the digit 3 {BOI}", max_new_tokens=12)
    eng = Engine(mm, EngineConfig(max_num_seqs=4, max_model_len=256))
    try:
        out = eng.generate([res.prompt_ids], SamplingParams(max_new_tokens=12))[0]
    finally:
        eng.close()
    n = len(res.answer_ids)
    assert out.new_token_ids[:n] == res.answer_ids
    assert set(out.token_adapters) <= {"image", "text"}


# --------------------------------------------------------------------------------------------- constrained spans served


@pytest.fixture(scope="module")
def spans_bundle(tiny_bundle, tmp_path_factory):
    """The tiny bundle's base and adapters under a manifest that declares the digits' constrained spans."""
    from molora.multimodal.recipe import SPANS

    folder = tmp_path_factory.mktemp("digits_spans")
    write_manifest(
        folder,
        {
            "name": "tiny-digits-spans",
            "base": str(tiny_bundle / "base"),
            "prompt_template": "<bos> {prompt}",
            "stop": ["<eos>"],
            "router": {"kind": "vocab"},
            "vocab_routes": ROUTES,
            "extra": {"constrained_spans": SPANS},
            "adapters": [{"name": n, "path": str(tiny_bundle / "adapters" / n)} for n in ("image", "text")],
        },
    )
    return folder


def _check_spans(tokens: list[int], tok, in_span: bool, count: int = 0) -> int:
    """Walk prompt-continuing ids: inside a span only codes, exactly 64 of them, then <eoi>; outside neither
    codes nor <eoi>. Returns how many spans closed."""
    boi, codes = mg.image_token_ids(tok)
    eoi = tok.convert_tokens_to_ids("<eoi>")
    closed = 0
    for t in tokens:
        if in_span and count < PIXELS:
            assert t in codes, (t, count)
            count += 1
        elif in_span:
            assert t == eoi, (t, count)
            in_span, count, closed = False, 0, closed + 1
        else:
            assert t not in codes and t != eoi, t
            in_span, count = t == boi, 0
    return closed


def test_span_constraint_state_follows_the_ids_so_far():
    from molora.sampling import SpanConstraint

    sc = SpanConstraint(open_id=1, close_id=2, code_ids=(5, 6), length=3)
    assert sc.state([9, 9]) == 2 and sc.state([9, 1]) == 0 and sc.state([1, 5, 6]) == 0
    assert sc.state([1, 5, 6, 5]) == 1 and sc.state([1, 5, 6, 5, 2]) == 2 and sc.state([1, 5, 2, 9]) == 2
    out = sc.apply(torch.zeros(3, 8), [[9], [1, 5], [1, 5, 5, 5]])
    assert torch.isfinite(out).tolist() == [
        [True, True, False, True, True, False, False, True],
        [False, False, False, False, False, True, True, False],
        [False, False, True, False, False, False, False, False],
    ]


def test_span_constraint_reads_token_names_and_refuses_bad_specs(tiny_bundle):
    from molora.errors import MoLoRAError
    from molora.multimodal.recipe import SPANS
    from molora.sampling import SpanConstraint, bundle_constraint

    vocab = build_tokenizer().get_vocab()
    sc = SpanConstraint.from_vocab(vocab, SPANS)
    assert (sc.open_id, sc.close_id, sc.length) == (vocab[BOI], vocab["<eoi>"], PIXELS)
    assert sc.code_ids == tuple(vocab[c] for c in CODES)
    with pytest.raises(MoLoRAError, match="not in the vocabulary"):
        SpanConstraint.from_vocab(vocab, {**SPANS, "close": "<end_of_image>"})
    with pytest.raises(MoLoRAError, match="starts with"):
        SpanConstraint.from_vocab(vocab, {**SPANS, "codes": ["IMGIMG"]})
    with pytest.raises(MoLoRAError, match="lacks"):
        SpanConstraint.from_vocab(vocab, {"open": BOI})
    assert bundle_constraint(read_bundle(tiny_bundle), build_tokenizer()) is None  # declares none


def test_engine_applies_the_manifests_constrained_spans(spans_bundle):
    """Inside an image span only codes come out, exactly 64, then <eoi>; outside no codes: greedy and sampled,
    prompts outside a span, at <boi> and inside one."""
    from molora.config import SamplingParams
    from molora.engine import Engine, EngineConfig

    mm = load(spans_bundle)
    tok = mm.tokenizer
    prompts = {
        "draw the digit 3": (False, 0),
        f"draw the digit 3 {BOI}": (True, 0),
        f"{BOI} " + " ".join(CODES[q] for q in range(10)): (True, 10),
    }
    eng = Engine(mm, EngineConfig(max_num_seqs=8, max_model_len=160))
    assert eng.constraint is not None
    try:
        for temperature in (0.0, 1.0):
            ids = [mg.encode(mm, p) for p in prompts]
            params = [
                SamplingParams(max_new_tokens=90, temperature=temperature, seed=s, ignore_eos=True)
                for s in range(len(ids))
            ]
            outs = eng.generate(ids, params)
            closed = [_check_spans(o.new_token_ids, tok, *state) for o, state in zip(outs, prompts.values())]
            assert closed[1] >= 1 and closed[2] >= 1, closed
    finally:
        eng.close()


def test_engine_greedy_equals_the_demos_constrained_generation(spans_bundle):
    """The served constraint and the demo's own (molora.multimodal.generate) give the same greedy image span."""
    from molora.config import SamplingParams
    from molora.engine import Engine, EngineConfig

    mm = load(spans_bundle)
    digits = [0, 3, 8]
    demo = mg.draw(mm, digits, mm.router)
    eng = Engine(mm, EngineConfig(max_num_seqs=4, max_model_len=160))
    try:
        outs = eng.generate(
            [mg.encode(mm, f"draw the digit {d} {BOI}") for d in digits], SamplingParams(max_new_tokens=PIXELS + 1)
        )
    finally:
        eng.close()
    assert [o.new_token_ids for o in outs] == [d.tokens[: PIXELS + 1] for d in demo]


def test_shipped_bundle_served_greedy_equals_the_demos_draws():
    """The trained bundle declares its spans: the engine's greedy answers (image, caption, <eos>) are the
    demo's constrained draws, token for token, under the vocab router."""
    from molora.config import SamplingParams
    from molora.engine import Engine, EngineConfig
    from molora.multimodal.recipe import shipped_bundle

    mm = load(shipped_bundle())
    digits = list(range(10))
    demo = mg.draw(mm, digits, mm.router)
    eos = mm.tokenizer.convert_tokens_to_ids("<eos>")
    eng = Engine(mm, EngineConfig(max_num_seqs=10, max_model_len=160))
    try:
        outs = eng.generate(
            [mg.encode(mm, f"draw the digit {d} {BOI}") for d in digits],
            SamplingParams(max_new_tokens=80, stop_token_ids=(eos,)),
        )
    finally:
        eng.close()
    assert [o.new_token_ids for o in outs] == [d.tokens + [eos] for d in demo]


def test_generate_cli_and_server_constrain_the_bundles_spans(spans_bundle, capsys):
    from fastapi.testclient import TestClient

    from molora.cli import main
    from molora.engine import Engine, EngineConfig
    from molora.server.app import create_app

    assert main(["generate", f"draw the digit 5 {BOI}", "--bundle", str(spans_bundle), "--max-tokens", "70"]) == 0
    words = capsys.readouterr().out.split()
    assert words[:PIXELS] == [w for w in words[:PIXELS] if w in CODES] and words[PIXELS] == "<eoi>"
    mm = load(spans_bundle)
    with TestClient(create_app(Engine(mm, EngineConfig(max_num_seqs=2, max_model_len=160)))) as c:
        r = c.post(
            "/v1/completions",
            json={
                "model": "tiny-digits-spans",
                "max_tokens": 70,
                "temperature": 1.0,
                "seed": 4,
                "prompt": f"<bos> draw the digit 5 {BOI}",
            },
        )
    assert r.status_code == 200, r.text
    words = r.json()["choices"][0]["text"].split()
    assert all(w in CODES for w in words[:PIXELS]) and words[PIXELS] == "<eoi>"


# --------------------------------------------------------------------------------------------- training


def test_train_routed_writes_peft_folders_that_peft_loads(tmp_path, tiny_bundle):
    """Joint training under the vocab router moves both adapters (each on its own tokens) and saves PEFT
    folders; PEFT loads them and gives the same logits as molora on tokens of one adapter."""
    from peft import PeftModel

    from molora.adapters.io import read_adapter_config
    from molora.model.base import load_base
    from molora.multimodal.vocab import END, PROMPT_TEMPLATE, Digits, adapter_pairs
    from molora.train.adapter import AdapterTrainConfig, train_routed

    rng = np.random.RandomState(0)
    data = Digits(rng.randint(0, 16, size=(8, PIXELS)), np.arange(8) % 10)
    pairs = adapter_pairs(data, "inverted", "new", captioning=0.25)
    model, tok = load_base(tiny_bundle / "base")
    router = VocabRouter.from_vocab(tok.get_vocab(), ROUTES["from_tokenizer"], "text")
    outs = {n: tmp_path / n for n in ("image", "text")}
    cfg = AdapterTrainConfig(
        rank=4, alpha=8, lr=1e-2, epochs=1, batch_size=4, bf16=False, target_modules=("q_proj", "v_proj")
    )
    stats = train_routed(model, tok, pairs, outs, router, cfg, template=PROMPT_TEMPLATE, end=END, progress=False)
    assert stats["steps"] == 2 and math.isfinite(stats["final_loss"])
    for p in outs.values():
        assert read_adapter_config(p).r == 4
        assert json.loads((p / "training_stats.json").read_text())["trained_with"] == ["image", "text"]
    fresh, _ = load_base(tiny_bundle / "base")
    ids = tok(f"<bos> draw the digit 1 {BOI}", add_special_tokens=False, return_tensors="pt")["input_ids"][:, :-1]
    ref = fresh(ids).logits
    peft = PeftModel.from_pretrained(fresh, str(outs["text"]))
    got = peft(ids).logits
    assert not torch.allclose(got, ref, atol=1e-6)  # B moved off zero: the text tokens were trained
    import molora

    base2, _ = load_base(tiny_bundle / "base")
    mm2 = molora.attach(base2, {"text": outs["text"]}, check_base=False)
    assert torch.allclose(mm2(ids, adapter_ids="text").logits, got, atol=1e-4)


def test_train_routed_cli_is_train_routed_under_the_bundles_router(tmp_path, tiny_bundle, capsys):
    """`molora train-routed DATA --routed-with BUNDLE --out DIR` writes DIR/image and DIR/text, the same weights
    as `train_routed` under the bundle's vocab router with the bundle's template and end token; a bundle
    without a vocab router is refused with a message naming its kind."""
    from safetensors.torch import load_file

    from molora.cli import main
    from molora.model.base import load_base
    from molora.multimodal.vocab import END, PROMPT_TEMPLATE, Digits, adapter_pairs
    from molora.train.adapter import AdapterTrainConfig, train_routed

    rng = np.random.RandomState(1)
    pairs = adapter_pairs(
        Digits(rng.randint(0, 16, size=(6, PIXELS)), np.arange(6) % 10), "inverted", "new", captioning=0.3
    )
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in pairs))
    flags = ["--rank", "4", "--alpha", "8", "--lr", "1e-2", "--batch-size", "3", "--targets", "q_proj,v_proj"]
    assert (
        main(["train-routed", str(data), "--routed-with", str(tiny_bundle), "--out", str(tmp_path / "cli"), *flags])
        == 0
    )
    assert "final loss" in capsys.readouterr().out
    model, tok = load_base(tiny_bundle / "base")
    router = VocabRouter.from_vocab(tok.get_vocab(), ROUTES["from_tokenizer"], "text")
    cfg = AdapterTrainConfig(rank=4, alpha=8, lr=1e-2, batch_size=3, bf16=False, target_modules=("q_proj", "v_proj"))
    train_routed(
        model,
        tok,
        pairs,
        {n: tmp_path / "lib" / n for n in ("image", "text")},
        router,
        cfg,
        template=PROMPT_TEMPLATE,
        end=END,
        progress=False,
    )
    for n in ("image", "text"):
        got = load_file(str(tmp_path / "cli" / n / "adapter_model.safetensors"))
        want = load_file(str(tmp_path / "lib" / n / "adapter_model.safetensors"))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
        assert json.loads((tmp_path / "cli" / n / "training_stats.json").read_text())["trained_with"] == [
            "image",
            "text",
        ]
    plain = tmp_path / "plain"
    write_manifest(
        plain, {"name": "plain", "base": str(tiny_bundle / "base"), "router": {"kind": "none"}, "adapters": []}
    )
    assert main(["train-routed", str(data), "--routed-with", str(plain), "--out", str(tmp_path / "x")]) == 2
    assert "router kind 'none'" in capsys.readouterr().err


def test_read_bundle_keeps_from_tokenizer_routes(tiny_bundle):
    assert read_bundle(tiny_bundle).vocab_routes == ROUTES


def test_openai_server_serves_the_bundle_text_in_codes_out(tiny_bundle):
    """The unchanged server: a text prompt in, the answer's image codes as text out (greedy, the same ids as
    the engine), which `levels_from_text` turns into a picture."""
    from fastapi.testclient import TestClient

    from molora.config import SamplingParams
    from molora.engine import Engine, EngineConfig
    from molora.server.app import create_app

    mm = load(tiny_bundle)
    eng = Engine(mm, EngineConfig(max_num_seqs=4, max_model_len=256))
    prompt = f"draw the digit 3 {BOI} " + " ".join(CODES[q] for q in (1, 2, 3))
    ids = mm.tokenizer(f"<bos> {prompt}", add_special_tokens=False)["input_ids"]
    want = eng.generate([ids], SamplingParams(max_new_tokens=16))[0].new_token_ids
    with TestClient(create_app(eng)) as c:
        r = c.post(
            "/v1/chat/completions",
            json={
                "model": "tiny-digits",
                "max_tokens": 16,
                "temperature": 0,
                "messages": [{"role": "user", "content": prompt}],
            },
        )
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    stops = {mm.tokenizer.convert_tokens_to_ids("<eos>")}
    want = [t for t in want if t not in stops]
    assert text.split() == mm.tokenizer.decode(want, skip_special_tokens=True).split()
    levels = mg.levels_from_text(f"{prompt} {text}")
    assert levels[:3].tolist() == [1, 2, 3]


# --------------------------------------------------------------------------------------------- the shipped bundle


@pytest.mark.slow
def test_shipped_digits_bundle_keeps_both_styles_in_one_sequence(tmp_path):
    """The trained bundle, end to end: PEFT loads its adapters; vocab-routed draws keep the image style on the
    image and the text style on the caption; `molora generate`'s unconstrained path returns an image as codes
    that become a PNG; the demo writes its grid."""
    from peft import PeftModel

    from molora.bundle import run_prompt
    from molora.cli import main
    from molora.model.base import load_base
    from molora.multimodal.evaluate import fit_reader, score_draws
    from molora.multimodal.recipe import shipped_bundle
    from molora.multimodal.vocab import load_splits

    torch.set_num_threads(1)
    folder = shipped_bundle()
    base, _ = load_base(folder / "base")
    PeftModel.from_pretrained(base, str(folder / "adapters" / "image"))
    mm = load(folder)
    digits = [i % 10 for i in range(30)]
    drawn = mg.draw(mm, digits, mm.router, temperature=1.0, text_temperature=0.0, seed=5)
    scores = score_draws(fit_reader(load_splits()), digits, drawn)
    # docs/multimodal.json has the 100-draw figures; 30 draws leave about +-0.09 of noise
    assert scores["inverted"] >= 0.9 and scores["new_phrasing"] >= 0.9 and scores["broken"] <= 0.1, scores
    assert scores["image_accuracy"] >= 0.35 and scores["caption_accuracy"] >= 0.45, scores
    text = run_prompt(mm, "draw the digit 3", max_new_tokens=72).text
    assert mg.levels_from_text(text).shape == (PIXELS,)
    png = tmp_path / "grid.png"
    assert main(["demo", "--multimodal", "--png", str(png)]) == 0 and png.stat().st_size > 1000


def test_page_block_and_results_section_render_from_the_record():
    """docs/multimodal.json is the only source of docs/multimodal.md's block (tools/make_multimodal.py)."""
    from pathlib import Path

    from molora.docblock import from_docs

    root = Path(__file__).resolve().parent.parent
    record = root / "docs" / "multimodal.json"
    if not record.is_file():
        pytest.skip("no docs/multimodal.json yet: run tools/make_multimodal.py")
    mod = load_script("make_multimodal")
    rec = json.loads(record.read_text())
    page = (root / "docs" / "multimodal.md").read_text()
    assert from_docs(f"{mod.BEGIN}\n{mod.readme_block(rec)}\n{mod.END}") in page, (
        "re-run tools/make_multimodal.py --render-only"
    )
    assert any(line.startswith("## Multimodal") for line in mod.render_section(rec))
