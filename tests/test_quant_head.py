"""The LM head under int8 or w8a8 (`quantize_head`): the tied head and the input embeddings share one int8 copy, the
logits stay within the int8 rounding's bound of the float head, the model equals the float model on the dequantized
weights (a case of test_quant's routing test), and bad requests are refused with nothing changed.

Tolerances: the head's logits differ from the float head's by at most ||h||_1 * scale_n / 2 per vocabulary row n (each
weight moves by at most half a step), plus 1e-5 of the largest logit for the order of float32 sums; the whole model
against the float model on the dequantized weights within 1e-4 (test_runner's TOL), as in test_quant.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import molora
from molora.errors import MoLoRAError
from molora.model.quant_linear import QuantizedEmbedding, QuantizedLinear, quantize_head, weight_bytes
from molora.model.runner import BatchMeta, ModelRunner, StepRouting
from molora.ops import quant
from tests.conftest import VOCAB, tiny_model


def _head_model(dtype: torch.dtype = torch.float32, scheme: str = "int8") -> molora.MoLoRAModel:
    mm = molora.attach(tiny_model("llama"), {}, quantization=scheme, quantize_lm_head=True)
    return mm.to(dtype)


@pytest.mark.parametrize("scheme", ["int8", "w8a8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tied_head_and_the_embeddings_hold_one_int8_copy(dtype, scheme):
    mm = _head_model(dtype, scheme)
    head, emb = mm.model.lm_head, mm.model.model.embed_tokens
    assert isinstance(head, QuantizedLinear) and isinstance(emb, QuantizedEmbedding) and emb.head is head
    v, d = head.out_features, head.in_features
    assert list(emb.parameters()) == [] and list(emb.buffers()) == []  # it reads the head's buffers
    runner = ModelRunner(mm, num_blocks=16, block_size=4, max_model_len=64, pack_weights=True)
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        runner(ids.reshape(-1), torch.arange(6).repeat(2), BatchMeta([6, 6], [6, 6], [[0, 1], [2, 3]]),
               StepRouting(torch.full((12, 1), -1)), logits=True)  # fmt: skip
    wb = weight_bytes(mm.model, runner.packed_weights())
    # no float [V, D] matrix anywhere: the float parameters are the norms alone, no kernel copy of the head
    assert wb["float"] < v * d * dtype.itemsize // 4
    assert not any(t.numel() >= v * d for t in runner.packed_weights())
    quantized = [m for m in mm.modules() if isinstance(m, QuantizedLinear)]
    assert wb["quantized"] == sum(m.nbytes() for m in quantized)  # the head counted once, with its scales
    float_head = molora.attach(tiny_model("llama"), {}, quantization=scheme, quantize_lm_head=False).to(dtype)
    fb, qb = weight_bytes(float_head.model), weight_bytes(mm.model)
    saved = fb["quantized"] + fb["float"] - qb["quantized"] - qb["float"]  # the model's own tensors
    assert saved == v * d * dtype.itemsize - head.nbytes()  # one float [V, D] matrix less, one int8 head more


def test_int8_head_logits_stay_within_half_a_step_of_the_float_head():
    model = tiny_model("llama")
    lin = model.lm_head
    q = QuantizedLinear(lin, "int8")
    h = torch.randn(9, lin.in_features, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        yq, yf = q(h), lin(h)
    bound = h.abs().sum(1, keepdim=True) * q.scales.float()[None] / 2  # [9, V]: each weight within half a step
    assert ((yq - yf).abs() <= bound + 1e-5 * yf.abs().max()).all()
    assert (yq - yf).abs().max() > 0  # the head is rounded (the test would not see a float head)


@pytest.mark.parametrize("tiled", [False, True])
def test_embeddings_read_the_heads_rows_dequantized_in_either_layout(tiled):
    mm = _head_model(torch.bfloat16)
    head, emb = mm.model.lm_head, mm.model.model.embed_tokens
    rows, scales = head.rows().clone(), head.scales
    if tiled:  # the layout AMX keeps (made here by hand: this test does not need the tile unit)
        with torch.no_grad():
            head.qweight, head.tiled = quant.tiles(head.qweight), True
    ids = torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(7))
    ref = (quant.dequantize_int8(rows, scales)[ids.reshape(-1)]).to(torch.bfloat16).view(3, 5, -1)
    with torch.no_grad():
        assert torch.equal(emb(ids), ref)
        assert torch.equal(quant.take_tiles(quant.tiles(rows), ids.reshape(-1)), rows[ids.reshape(-1)])


def test_head_quantization_is_refused_where_it_cannot_apply_and_changes_nothing():
    for scheme in ("int4", None):
        model = tiny_model("llama")
        with pytest.raises(MoLoRAError, match="quantize_lm_head needs quantization='int8' or 'w8a8'"):
            molora.attach(model, {}, quantization=scheme, quantize_lm_head=True)
        assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    model = tiny_model("llama")
    model.lm_head = nn.Identity()  # no linear head: refused before any linear is quantized
    with pytest.raises(MoLoRAError, match="no plain nn.Linear LM head"):
        molora.attach(model, {}, quantization="int8", quantize_lm_head=True)
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="int8 or w8a8 only"):
        quantize_head(model, "int4")
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.model.embed_tokens.weight
    with pytest.raises(ValueError, match="unsmoothed int8 or w8a8 head only"):
        QuantizedEmbedding(QuantizedLinear(tiny_model("llama").lm_head, "int4"))
    lin = tiny_model("llama").lm_head  # a smoothed head's rows are W * s, not W: the embeddings cannot read them
    with pytest.raises(ValueError, match="unsmoothed int8 or w8a8 head only"):
        QuantizedEmbedding(QuantizedLinear(lin, "w8a8", act_amax=torch.ones(lin.in_features)))


def test_an_untied_head_is_quantized_alone():
    model = tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())  # untie
    emb = model.model.embed_tokens
    assert quantize_head(model, "int8") == ["lm_head"]
    assert isinstance(model.lm_head, QuantizedLinear) and model.model.embed_tokens is emb


def test_serve_takes_the_lm_head_flag():
    import argparse

    from molora.cli.serve import _serve_args

    p = argparse.ArgumentParser()
    _serve_args(p)
    assert p.parse_args(["-q", "int8", "--quantize-lm-head"]).quantize_lm_head is True
    assert p.parse_args(["-q", "int8"]).quantize_lm_head is None  # attach's default (HEAD_SCHEMES)


def test_quant_eval_intervals_cover_the_difference_and_never_collapse():
    from tests.conftest import load_script

    qe = load_script("quant_eval")
    same = qe.paired_ci95("1" * 100, "1" * 100)  # no discordant item: still an interval around 0
    assert same[0] < 0 < same[1] and same[1] - same[0] > 3
    lo, hi = qe.paired_ci95("1" * 90 + "0" * 10, "1" * 80 + "0" * 20)  # +10 points, 10 items only a got right
    assert lo < 10 < hi and lo > 0
    wide, narrow = qe.paired_ci95("10" * 12, "01" * 12), qe.paired_ci95("10" * 200, "01" * 200)
    assert narrow[1] - narrow[0] < wide[1] - wide[0]  # more items, a narrower interval
    a, b = qe.wilson95(57, 60)
    assert a < 57 / 60 < b <= 1 and qe.wilson95(60, 60)[1] == pytest.approx(1)
