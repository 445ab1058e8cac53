"""The llama.cpp peer (molora.bench.peer, molora.bench.peer_gguf): the LoRA GGUF a llama.cpp adapter loader expects,
the float base GGUFs, the message when llama-cpp-python is absent, and (only where it imports) llama.cpp's greedy
tokens on a tiny Llama equal to the transformers model's, with and without a converted LoRA."""

from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np
import pytest
import torch

from molora.adapters.io import read_adapter
from molora.bench import engine as engine_bench
from molora.bench import peer
from molora.bench.peer_gguf import gguf_lora_tensors, lora_to_gguf, permute_rows, write_float_gguf
from molora.errors import MoLoRAError
from molora.model.lora_linear import linear_shapes
from tests.conftest import gen, make_peft_adapter, tiny_config, tiny_model

gguf = pytest.importorskip("gguf")
SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GGUF_NAMES = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}


def tiny_adapter(tmp_path, **kw):
    folder = make_peft_adapter(tmp_path / "lora", "llama", r=4, alpha=8, targets=SEVEN, **kw)
    return read_adapter(folder, linear_shapes(tiny_model("llama")))


def test_lora_gguf_has_llama_cpp_names_shapes_and_alpha(tmp_path):
    adapter = tiny_adapter(tmp_path)
    cfg = tiny_config("llama")
    out = lora_to_gguf(adapter, tmp_path / "a.gguf", cfg.num_attention_heads, cfg.num_key_value_heads, 2)
    r = gguf.GGUFReader(str(out))
    assert r.fields["general.type"].contents() == "adapter"
    assert r.fields["general.architecture"].contents() == "llama"
    assert r.fields["adapter.type"].contents() == "lora"
    assert r.fields["adapter.lora.alpha"].contents() == pytest.approx(8.0)
    tensors = {t.name: t for t in r.tensors}
    want = {f"blk.{i}.{n}.weight.lora_{ab}" for i in range(2) for n in GGUF_NAMES.values() for ab in "ab"}
    assert set(tensors) == want
    for module, m in adapter.modules.items():
        layer, proj = module.split(".")[2], module.rsplit(".", 1)[-1]
        stem = f"blk.{layer}.{GGUF_NAMES[proj]}.weight"
        a, b = tensors[f"{stem}.lora_a"], tensors[f"{stem}.lora_b"]
        d_out, d_in = m.B.shape[0], m.A.shape[1]
        assert list(a.shape) == [d_in, 4] and list(b.shape) == [4, d_out]  # GGUF ne: [d_in, r] and [r, d_out]
        assert a.tensor_type == b.tensor_type == gguf.GGMLQuantizationType.F32
        assert torch.equal(torch.from_numpy(np.array(a.data)), m.A)
        heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}.get(proj)
        expect_b = permute_rows(m.B, heads) if heads else m.B
        assert torch.equal(torch.from_numpy(np.array(b.data)), expect_b)


def test_permute_rows_is_what_transformers_undoes_when_it_loads_a_gguf():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    undo = LlamaTensorProcessor(config={})._reverse_permute_weights
    w = torch.randn(4 * 16, 24, generator=gen(1))
    for n_head in (4, 2):
        back = undo(permute_rows(w, n_head).numpy(), n_head, n_head)
        assert torch.equal(torch.from_numpy(back), w)
        assert not torch.equal(permute_rows(w, n_head), w)  # a real reordering, not the identity


def test_one_alpha_is_written_for_rslora_and_scales_fold_into_b_when_alphas_differ(tmp_path):
    rs = tiny_adapter(tmp_path / "rs", rslora=True)  # PEFT scale alpha / sqrt(r): alpha * sqrt(r) / r is the same
    alpha, _ = gguf_lora_tensors(rs, 4, 2, 2)
    assert alpha == pytest.approx(8 * 4**0.5)
    mixed = tiny_adapter(tmp_path / "mixed", alpha_pattern={"v_proj": 16})
    alpha, tensors = gguf_lora_tensors(mixed, 4, 2, 2)
    assert alpha == 0.0  # llama.cpp: scale 1, the per-module scale is in B
    m = mixed.modules["model.layers.0.self_attn.v_proj"]
    assert m.scale == pytest.approx(16 / 4)
    assert torch.allclose(dict(tensors)["blk.0.attn_v.weight.lora_b"], m.B * m.scale)


def test_modules_outside_the_blocks_are_refused_by_name(tmp_path):
    adapter = tiny_adapter(tmp_path)
    one = next(iter(adapter.modules.values()))
    bad = dataclasses.replace(adapter, modules={"lm_head": one})
    with pytest.raises(MoLoRAError, match="lm_head"):
        gguf_lora_tensors(bad, 4, 2, 2)


def test_float_gguf_holds_the_dequantized_weights_and_the_metadata(tmp_path):
    w = torch.randn(8, 64, generator=gen(2)).numpy()
    norm = torch.rand(64, generator=gen(3)).numpy()
    src = tmp_path / "src.gguf"
    wr = gguf.GGUFWriter(str(src), "llama")
    wr.add_block_count(1)
    wr.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q8_0))
    wr.add_token_list(["a", "b"])
    q8 = gguf.GGMLQuantizationType.Q8_0
    wr.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(w, q8), raw_dtype=q8)
    wr.add_tensor("blk.0.attn_norm.weight", norm)
    wr.write_header_to_file(), wr.write_kv_data_to_file(), wr.write_tensors_to_file(), wr.close()
    dq = gguf.quants.dequantize(gguf.quants.quantize(w, q8), q8)
    for ftype, file_type in (("F32", gguf.LlamaFileType.ALL_F32), ("BF16", gguf.LlamaFileType.MOSTLY_BF16)):
        r = gguf.GGUFReader(str(write_float_gguf(src, tmp_path / f"{ftype}.gguf", ftype)))
        assert r.fields["general.file_type"].contents() == int(file_type)
        assert r.fields["llama.block_count"].contents() == 1
        assert r.fields["tokenizer.ggml.tokens"].contents() == ["a", "b"]
        t = {x.name: x for x in r.tensors}
        assert list(t["blk.0.attn_q.weight"].shape) == [64, 8]  # GGUF ne: [d_in, d_out]
        assert t["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32  # 1-D stays F32
        got = gguf.quants.dequantize(t["blk.0.attn_q.weight"].data, t["blk.0.attn_q.weight"].tensor_type)
        expect = torch.from_numpy(dq).to(torch.bfloat16).float().numpy() if ftype == "BF16" else dq
        assert np.array_equal(got, expect)
    with pytest.raises(ValueError, match="F16"):
        write_float_gguf(src, tmp_path / "x.gguf", "F16")


def test_agreement_counts_tokens_before_the_first_difference():
    assert peer.agreement([[1, 2, 3], [4, 5]], [[1, 2, 9], [4, 5]]) == pytest.approx(4 / 5)
    assert peer.agreement([[1]], [[2]]) == 0.0


def test_absent_llama_cpp_skips_with_a_message(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    assert peer.load_llama_cpp() is None
    assert peer.main(["--variants", "fp32"]) == 0
    cap = capsys.readouterr()
    assert "llama-cpp-python is not installed" in cap.err and "molora[peer]" in cap.err
    assert json.loads(cap.out.strip().splitlines()[-1]) == {"bench": "peer", "skipped": peer.MISSING}
    assert engine_bench.main(["--peer", "llama.cpp", "--requests", "2"]) == 0  # the engine bench's route to it
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["skipped"] == peer.MISSING
    assert engine_bench.main(["--peer", "vllm"]) == 2
    assert "llama.cpp" in capsys.readouterr().err
    assert peer.main(["--speculative", '{"method": "ngram"}', "--items", "1"]) == 0  # prompt lookup beside it
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["skipped"] == peer.MISSING
    assert peer.main(["--speculative"]) == 2
    assert "speculative config" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ a real llama.cpp (when built)


def tiny_llama_gguf(model: torch.nn.Module, path):
    """The tiny transformers Llama as a llama.cpp GGUF (F32, a stand-in vocabulary of VOCAB plain tokens, q/k rows
    permuted as llama.cpp's converter does): what convert_hf_to_gguf.py would write, enough for llama.cpp to run."""
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    rope_theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(rope_theta))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_token_types([int(gguf.TokenType.NORMAL)] * cfg.vocab_size)
    w.add_token_merges(["t 0"])
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for key, t in model.state_dict().items():
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name = names.get_name(key, try_suffixes=(".weight",))
        if ".attn_q." in name:
            t = permute_rows(t, cfg.num_attention_heads)
        elif ".attn_k." in name:
            t = permute_rows(t, cfg.num_key_value_heads)
        w.add_tensor(name, t.float().contiguous().numpy())
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


@torch.no_grad()
def greedy(model: torch.nn.Module, prompts: list[list[int]], n: int) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = list(p)
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        out.append(ids[len(p) :])
    return out


def test_llama_cpp_repeats_the_transformers_greedy_tokens_with_and_without_a_converted_lora(tmp_path):
    llama = peer.load_llama_cpp()
    if llama is None:
        pytest.skip(peer.MISSING)
    model = tiny_model("llama")
    with torch.no_grad():  # a sharper next-token distribution: no near-ties for float noise to flip
        model.model.embed_tokens.weight.mul_(40.0)
    cfg = model.config
    base = tiny_llama_gguf(model, tmp_path / "tiny.gguf")
    adapter = tiny_adapter(tmp_path)
    lora = lora_to_gguf(adapter, tmp_path / "lora.gguf", cfg.num_attention_heads, cfg.num_key_value_heads, 2)
    g = gen(5)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in (11, 7, 13)]
    ref = greedy(model, prompts, 6)
    merged = tiny_model("llama")
    with torch.no_grad():
        merged.model.embed_tokens.weight.mul_(40.0)
        mods = dict(merged.named_modules())
        for name, m in adapter.modules.items():
            mods[name].weight += m.scale * m.B @ m.A
    ref_lora = greedy(merged, prompts, 6)
    assert ref != ref_lora  # the LoRA changes the greedy tokens: the comparison below can see a wrong conversion
    # n_batch 16: the prompts (31 tokens) need two decodes, so prefill chunks and decode tokens share batches
    p = peer.LlamaCppPeer(llama, base, n_seq=3, seq_len=32, n_batch=16, threads=1, kv_type="F32", lora_path=lora)
    try:
        p.use_lora(False)
        assert p.generate(prompts, [6, 6, 6]) == ref
        p.use_lora(True)
        assert p.generate(prompts, [6, 6, 6]) == ref_lora
        p.use_lora(False)
        assert p.generate(prompts, [6, 3, 1]) == [r[:n] for r, n in zip(ref, (6, 3, 1))]
    finally:
        p.close()


def test_llama_cpp_prompt_lookup_gives_its_plain_greedy_tokens_with_a_lora(tmp_path):
    """The speculative peer's llama.cpp side (molora.bench.peer_speculative.LlamaCppGreedy): with the binding's prompt
    lookup as its draft model, the same greedy ids as without it, on a prompt that repeats (drafts are made), with
    the LoRA on; a stop id ends the output there."""
    llama = peer.load_llama_cpp()
    if llama is None:
        pytest.skip(peer.MISSING)
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from molora.bench.peer_speculative import LlamaCppGreedy

    model = tiny_model("llama")
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(40.0)
    cfg = model.config
    base = tiny_llama_gguf(model, tmp_path / "tiny.gguf")
    lora = lora_to_gguf(
        tiny_adapter(tmp_path), tmp_path / "lora.gguf", cfg.num_attention_heads, cfg.num_key_value_heads, 2
    )
    prompt = torch.randint(3, cfg.vocab_size, (6,), generator=gen(9)).tolist() * 3
    plain = LlamaCppGreedy(llama, base, lora, 64, 1)
    fast = LlamaCppGreedy(llama, base, lora, 64, 1, LlamaPromptLookupDecoding(max_ngram_size=3, num_pred_tokens=4))
    ref = plain.generate(prompt, 12, set())
    assert len(ref) == 12 and fast.generate(prompt, 12, set()) == ref
    assert fast.generate(prompt, 12, set()) == ref  # a second prompt starts afresh
    assert plain.generate(prompt, 12, {ref[4]}) == ref[: ref.index(ref[4]) + 1]


def test_the_docs_section_renders_every_variant_of_the_committed_records():
    """Each committed record (make_peer.RECORDS: the weight-only int8's and the W8A8 era's) renders under its own
    heading, every variant's row with its figures, and the section holds both."""
    from tests.conftest import ROOT, load_script

    mp = load_script("make_peer")
    section = "\n".join(mp.section(ROOT / "docs"))
    assert section.startswith("## llama.cpp as a peer")
    found = 0
    for name, title, weights in mp.RECORDS:
        path = ROOT / "docs" / name
        if not path.is_file():
            continue
        found += 1
        rec = json.loads(path.read_text())
        lines = mp.record_lines(ROOT / "docs", name, title, weights)
        text = "\n".join(lines)
        assert lines[0] == f"### {title}" and text in section
        assert f"llama-cpp-python {rec['llama_cpp']['llama_cpp_python']}" in text
        assert f"{rec['llama_cpp']['n_threads']} thread(s)" in text
        for variant, v in rec["variants"].items():
            row = next(x for x in lines if x.startswith(f"| {variant} | {v['llama.cpp']['gguf_type']} |"))
            assert f"{v['tok_s']['molora']:.1f}" in row and f"{v['llama_over_molora'][0]:.2f}x" in row
            size = next(x for x in lines if x.startswith(f"| {variant} ("))
            assert f"{v['molora']['weight_bytes'] / 1e6:.1f}" in size
    assert found == len(mp.RECORDS)
