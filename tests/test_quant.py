"""Quantized base linears: the schemes' bounds, the kernels against the dequantize-then-matmul reference, and
per-token routing over a quantized base against the same routing over the dequantized weights.

int8 and int4 are weight only (int8 on molora's kernels: linear_w8 in float32, linear_amx_w8 in bfloat16 on AMX);
w8a8 rounds the activations to 8 bits per token too, after SmoothQuant's per-channel factors when the model was
calibrated (molora.ops.quant); the reference rounds the same values the same way and multiplies in float32.
Tolerances: float32 outputs within 1e-5 of the output's largest magnitude (the same products of the same values,
only the order of the float32 sums differs); bfloat16 within one rounding of the output (2^-8 relative, plus 1e-2
of the largest magnitude where a sum cancels).
Logits of the whole model in float32 within 1e-4 (test_runner's TOL).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import molora
from molora.errors import BundleError, MoLoRAError
from molora.model import quant_linear
from molora.model.lora_linear import RoutedLoRALinear, linear_shapes
from molora.model.quant_linear import QuantizedLinear, quantize_linears, weight_bytes
from molora.model.runner import BatchMeta, ModelRunner, StepRouting
from molora.ops import fused_cpu, quant
from tests.conftest import VOCAB, make_peft_adapter, tiny_model

SCHEMES = ("int8", "int4", "w8a8")
SPECS = {
    "a": {"r": 4, "alpha": 8, "targets": ("q_proj", "v_proj", "down_proj")},
    "b": {"r": 8, "alpha": 4, "targets": ("q_proj", "k_proj", "o_proj", "gate_proj", "up_proj", "down_proj")},
}


def _assert_kernel_matches(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert y.dtype == ref.dtype and y.shape == ref.shape
    big = ref.float().abs().max().item()
    diff = (y.float() - ref.float()).abs()
    if y.dtype == torch.float32:
        assert diff.max().item() <= 1e-5 * big, diff.max().item()
    else:
        assert (diff <= ref.float().abs() * 2**-8 + 1e-2 * big).all(), diff.max().item()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantization_error_is_within_half_a_step(scheme):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=g)
    w[3] = 0  # an all-zero row quantizes to zeros
    q, scales = quant.quantize(w, scheme)
    dq = quant.dequantize(q, scales, scheme, quant.INT4_GROUP, tuple(w.shape))
    assert dq[3].abs().max() == 0
    if scheme in ("int8", "w8a8"):
        assert q.dtype == torch.int8 and q.abs().max() <= 127 and scales.shape == (48,)
        step = scales[:, None]
    else:
        assert scales.shape == (128 // quant.INT4_GROUP, 48, 2)
        step = scales[..., 0].t().repeat_interleave(quant.INT4_GROUP, 1)  # [N, K]
        assert torch.equal(quant.unpack_int4(q, (48, 128)).clamp(0, 15), quant.unpack_int4(q, (48, 128)))
    assert ((dq - w).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("scheme", [*SCHEMES, "w8a8-smooth"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 3, 33, 130])
def test_quantized_kernel_equals_dequantize_then_matmul(scheme, dtype, T):
    g = torch.Generator().manual_seed(T)
    base = nn.Linear(96, 64, bias=True)
    with torch.no_grad():
        base.weight.copy_(torch.randn(64, 96, generator=g) * 0.1)
        base.bias.copy_(torch.randn(64, generator=g))
    amax = torch.rand(96, generator=g) * torch.logspace(-1, 2, 96) if scheme == "w8a8-smooth" else None
    layer = QuantizedLinear(base.to(dtype), scheme.removesuffix("-smooth"), act_amax=amax)
    assert (layer.smooth is not None) == (amax is not None)
    x = torch.randn(T, 96, generator=g).to(dtype)
    with torch.no_grad():
        _assert_kernel_matches(layer(x), layer.reference(x))
        x3 = x.reshape(1, T, 96)  # [..., d_in] keeps its leading shape
        _assert_kernel_matches(layer(x3), layer.reference(x3))


@pytest.mark.parametrize("scheme", ["int8", "w8a8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_rows_do_not_depend_on_the_rest_of_the_batch(dtype, scheme):
    g = torch.Generator().manual_seed(3)
    base = nn.Linear(96, 64, bias=False)
    with torch.no_grad():
        base.weight.copy_(torch.randn(64, 96, generator=g))
    layer = QuantizedLinear(base.to(dtype), scheme)
    x = (torch.randn(9, 96, generator=g) * torch.logspace(-2, 2, 9)[:, None]).to(dtype)  # rows of unlike ranges
    with torch.no_grad():
        whole = layer(x)
        for i in range(9):
            assert torch.equal(layer(x[i : i + 1]), whole[i : i + 1]), i


def test_smoothing_moves_range_between_activations_and_weights_in_powers_of_two():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(32, 64, generator=g)
    amax = torch.rand(64, generator=g) * 100
    s = quant.smoothing(amax, w, 0.5)
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two: x / s and W * s are exact
    x = torch.randn(5, 64, generator=g)
    assert torch.equal((x / s) * s, x) and torch.equal((w * s) / s, w)  # scaling by s loses nothing
    assert torch.allclose((x / s) @ (w * s).t(), x @ w.t(), rtol=1e-5, atol=1e-5)
    base = nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        base.weight.copy_(w)
    layer = QuantizedLinear(base, "w8a8", act_amax=amax)
    assert torch.equal(layer.smooth, 1 / s)
    step = (w * s).abs().amax(dim=1, keepdim=True) / 127 / s  # a half step of W * s, taken back to W's scale
    assert ((layer.dequantized() - w).abs() <= step / 2 + 1e-6).all()
    # a channel with large activations gets a larger step in W and a smaller one in x: its factor s is larger
    big = amax.argmax()
    assert s[big] >= s[amax.argmin()]
    with pytest.raises(ValueError, match="input channel"):
        QuantizedLinear(base, "w8a8", act_amax=torch.ones(63))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("smooth", [False, True])
def test_w8a8_rounding_and_scaling_kernels_equal_torchs_ops_bit_for_bit(dtype, smooth):
    """quantize_rows / scale_rows (csrc/linear_w8a8.cpp) are what linear_w8a8 runs around torch._int_mm where built:
    the same int8 rows and steps as quantize_tokens, the same outputs as acc.float() * step * scales in x's dtype."""
    if not fused_cpu.available():
        pytest.skip(f"no kernel build here: {fused_cpu.unavailable_reason()}")
    g = torch.Generator().manual_seed(21)
    for m, k, n in ((1, 64, 16), (7, 100, 33), (40, 576, 96)):  # odd widths take the kernels' scalar tails
        x = (torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[:, None]).to(dtype)
        x[0, :3] = 0.5 * x[0].abs().max()  # ties between two integers after the division: rounded half to even
        sm = torch.exp2(torch.randint(-4, 4, (k,), generator=g).float()) if smooth else None
        with torch.no_grad():
            xq, step = fused_cpu.quantize_rows(x, sm)
            ref_q, ref_step = quant.quantize_tokens(x, sm)
            assert torch.equal(xq, ref_q) and torch.equal(step, ref_step)
            acc = torch.randint(-(2**20), 2**20, (m, n), generator=g, dtype=torch.int32)
            scales = torch.rand(n, generator=g)
            ref = acc.float().mul_(ref_step).mul_(scales)
            assert torch.equal(fused_cpu.scale_rows(acc, step, scales, dtype), ref.to(dtype))
    assert fused_cpu.quantize_rows(torch.zeros(2, 8, dtype=torch.int8)) is None  # not float: torch's ops run


def test_w8a8_weight_packing_checks_its_inputs():
    q = torch.zeros(8, 16, dtype=torch.int8)
    with pytest.raises(ValueError, match="int8"):
        quant.prepack_w8a8(q.float(), torch.ones(8))
    with pytest.raises(ValueError, match="scales"):
        quant.prepack_w8a8(q, torch.ones(7))
    with pytest.raises(ValueError, match="smooth"):
        quant.prepack_w8a8(q, torch.ones(8), torch.ones(15))
    w = quant.prepack_w8a8(q, torch.ones(8))
    for x in (torch.ones(3, 15), torch.ones(16)):  # the wrong width, or not [T, K]
        with pytest.raises(ValueError, match=r"x must be \[T, 16\]"):
            quant.linear_w8a8(x, w)


def test_calibration_ranges_are_each_linears_input_maximum_and_attach_smooths_with_them(tmp_path):
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (4, 9)]
    seen: dict[str, torch.Tensor] = {}
    layer = model.model.layers[0].mlp.down_proj
    handle = layer.register_forward_pre_hook(
        lambda m, a: seen.__setitem__("x", torch.maximum(seen.get("x", torch.zeros(1)), a[0].abs().amax((0, 1))))
    )
    amax = quant_linear.activation_ranges(model, rows)
    handle.remove()
    assert "lm_head" not in amax and len(amax) == 7 * model.config.num_hidden_layers
    assert torch.equal(amax["model.layers.0.mlp.down_proj"], seen["x"])
    path = make_peft_adapter(tmp_path / "a", "llama", **SPECS["a"])
    mm = molora.attach(model, {"a": path}, quantization="w8a8", calibration=rows)
    smooths = [m.smooth for m in mm.modules() if isinstance(m, QuantizedLinear)]
    assert len(smooths) == 7 * mm.config.num_hidden_layers and all(s is not None for s in smooths)
    twin = _reference_twin(mm)
    ids = torch.randint(3, VOCAB, (2, 7), generator=g)
    with torch.no_grad():
        assert (mm(ids, adapter_ids="a").logits - twin(ids, adapter_ids="a").logits).abs().max() <= 1e-4


def test_quantizing_a_model_drops_its_float_weights_and_keeps_its_linear_shapes():
    model = tiny_model("llama")
    shapes, before = linear_shapes(model), weight_bytes(model)
    names = quantize_linears(model, "int8")
    assert "lm_head" not in names and len(names) == 7 * model.config.num_hidden_layers
    assert not any(type(m) is nn.Linear for n, m in model.named_modules() if n != "lm_head")
    assert linear_shapes(model) == shapes
    after = weight_bytes(model)
    assert after["quantized"] > 0 and after["float"] + after["quantized"] < before["float"]
    with pytest.raises(ValueError, match="int8"):
        quantize_linears(tiny_model("llama"), "int3")


def _reference_twin(mq: molora.MoLoRAModel) -> molora.MoLoRAModel:
    """A copy of `mq` whose quantized linears run the reference (dequantize, multiply in float32) for the kernel."""
    twin = copy.deepcopy(mq)
    for m in twin.modules():
        if isinstance(m, QuantizedLinear):
            m._kernel = m._reference_kernel
    return twin


def _dequantized_twin(mq: molora.MoLoRAModel, arch: str) -> nn.Module:
    """The tiny float model of `arch` whose quantized linears hold the dequantized weights of `mq`'s."""
    model = tiny_model(arch)
    mods = dict(mq.model.named_modules())
    with torch.no_grad():
        for name, m in model.named_modules():
            q = mods.get(name)
            q = q._modules.get("qbase") if isinstance(q, RoutedLoRALinear) else q
            if type(m) is nn.Linear and isinstance(q, QuantizedLinear):
                m.weight.copy_(q.dequantized())
    return model


@pytest.mark.parametrize(("scheme", "head"), [(s, False) for s in SCHEMES] + [("int8", True), ("w8a8", True)])
def test_per_token_routing_over_a_quantized_base_equals_routing_over_the_dequantized_weights(
    tmp_path, arch, scheme, head
):
    """head: the LM head in int8 too (quantize_lm_head); the float twin's tied head holds its dequantized rows (w8a8:
    the reference twin's head rounds the final hidden state as the kernel does)."""
    paths = {n: make_peft_adapter(tmp_path / n, arch, seed=i, **s) for i, (n, s) in enumerate(SPECS.items())}
    mq = molora.attach(tiny_model(arch), paths, quantization=scheme, quantize_lm_head=head)
    assert sum(isinstance(m, QuantizedLinear) for m in mq.modules()) == 7 * mq.config.num_hidden_layers + head
    # int8 and int4 are weight only: the float model on the dequantized weights; w8a8 also rounds its activations:
    # the quantized model on the reference kernel
    mf = molora.attach(_dequantized_twin(mq, arch), paths) if scheme != "w8a8" else _reference_twin(mq)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 11), generator=g)
    route = torch.randint(-1, 2, (2, 11), generator=g)  # per token: base, a or b
    with torch.no_grad():
        lq, lf = mq(ids, adapter_ids=route).logits, mf(ids, adapter_ids=route).logits
    assert (lq - lf).abs().max() <= 1e-4
    # the engine's runner: a ragged prefill step, then a decode step of both sequences (T = 2)
    outs = []
    for mm in (mq, mf):
        runner = ModelRunner(mm, num_blocks=16, block_size=4, max_model_len=64)
        slots = mm.slot_routing(molora.Routing(route), ids.shape)[0]  # [22, 1]
        with torch.no_grad():
            a = runner(
                ids.reshape(-1),
                torch.arange(11).repeat(2),
                BatchMeta([11, 11], [11, 11], [[0, 1, 2], [3, 4, 5]]),
                StepRouting(slots),
                logits=True,
            ).logits
            b = runner(
                torch.tensor([5, 6]),
                torch.tensor([11, 11]),
                BatchMeta([1, 1], [12, 12], [[0, 1, 2], [3, 4, 5]]),
                StepRouting(slots[[0, 11]]),
                logits=True,
            ).logits
        outs.append((a, b))
    assert (outs[0][0] - outs[1][0]).abs().max() <= 1e-4
    assert (outs[0][1] - outs[1][1]).abs().max() <= 1e-4


def test_a_quantized_model_runs_in_bfloat16_and_trains_adapters_through_the_reference(tmp_path):
    path = make_peft_adapter(tmp_path / "a", "llama", **SPECS["a"])
    mm = molora.attach(tiny_model("llama"), {"a": path}, quantization="int8")
    ids = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    mm_bf16 = copy.deepcopy(mm).to(torch.bfloat16)
    layer = mm_bf16.model.model.layers[0].self_attn.q_proj
    assert layer.qbase.scales.dtype == torch.bfloat16 and layer.qbase.qweight.dtype == torch.int8
    with torch.no_grad():
        l16 = mm_bf16(ids, adapter_ids="a").logits.float()
        l32 = mm(ids, adapter_ids="a").logits
    assert (l16 - l32).abs().max() <= 0.1 * l32.abs().max()
    bank = mm.bank.slots["model.layers.0.self_attn.q_proj"]
    bank.A.requires_grad_(True)  # gradients reach the adapters over int8
    mm(ids, adapter_ids="a").logits.sum().backward()
    assert bank.A.grad is not None and bank.A.grad.abs().sum() > 0


def test_quantization_is_checked_at_attach_and_in_bundles(tmp_path):
    with pytest.raises(MoLoRAError, match="int3"):
        molora.attach(tiny_model("llama"), quantization="int3")
    from molora.bundle import parse_manifest

    with pytest.raises(BundleError, match="quantization"):
        parse_manifest({"base": "default", "quantization": "fp4"}, tmp_path, "molora.json")
    assert parse_manifest({"base": "default", "quantization": "int4"}, tmp_path, "m").manifest["quantization"] == "int4"


def test_serve_takes_vllms_quantization_flag():
    import argparse

    from molora.cli.serve import _serve_args

    p = argparse.ArgumentParser()
    _serve_args(p)
    assert p.parse_args(["--quantization", "int8"]).quantization == "int8"
    assert p.parse_args([]).quantization is None
    with pytest.raises(SystemExit):
        p.parse_args(["--quantization", "fp8"])


def test_ray_replicas_take_the_quantization_and_check_it():
    pytest.importorskip("ray")
    from molora.server import ray_serve as rs

    assert rs.RayConfig(quantization="int8").quantization == "int8"
    assert rs.RayConfig().quantization is None
    with pytest.raises(MoLoRAError, match="--quantization 'int3'"):
        rs.RayConfig(quantization="int3")
    assert rs.RayConfig(quantization="int8", quantize_lm_head=True).quantize_lm_head is True
    assert rs.RayConfig(quantization="w8a8", quantize_lm_head=True).quantize_lm_head is True
    with pytest.raises(MoLoRAError, match="--quantize-lm-head needs --quantization int8 or w8a8, got 'int4'"):
        rs.RayConfig(quantization="int4", quantize_lm_head=True)


def test_ray_replicas_build_their_engines_with_the_lm_head_flag(monkeypatch):
    """A replica's engine is built with the config's quantization and LM-head flag (molora.server.launch)."""
    pytest.importorskip("ray")
    from molora.server import launch
    from molora.server import ray_deployments as rd
    from molora.server import ray_serve as rs

    seen = {}
    monkeypatch.setattr(launch, "build_engine", lambda *a, **k: seen.update(k) or "engine")
    assert rd.build_engine(rs.RayConfig(quantization="int8", quantize_lm_head=True), None) == "engine"
    assert seen == {"quantization": "int8", "quantize_lm_head": True}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 7, 50, 97])
def test_weight_only_int8_kernels_equal_the_dequantized_product(dtype, T):
    """linear_w8 (and linear_amx_w8 for bfloat16, where the CPU has AMX) on widths that leave tails (N = 50: not a
    multiple of the 4 channels a pass takes; T across the 6-row passes and 48-row chunks), with a bias, against x
    times the dequantized weight in float32; the same through the torch fallback where the kernels are suspended."""
    from molora.ops import fused_cpu, kernel_build

    if not fused_cpu.available():
        pytest.skip(f"no kernel build here: {kernel_build.unavailable_reason()}")
    g = torch.Generator().manual_seed(T)
    q, s = quant.quantize_int8(torch.randn(50, 64, generator=g))
    x, bias = torch.randn(T, 64, generator=g).to(dtype), torch.randn(50, generator=g).to(dtype)
    ref = (x.float() @ quant.dequantize_int8(q, s).t() + bias.float()).to(dtype)
    with torch.no_grad():
        y = fused_cpu.linear_w8(x, q, s, bias)
        assert y is not None
        _assert_kernel_matches(y, ref)
        if dtype == torch.bfloat16 and fused_cpu.amx():
            q2, s2 = quant.quantize_int8(torch.randn(48, 64, generator=g))
            ref2 = (x.float() @ quant.dequantize_int8(q2, s2).t()).to(dtype)
            _assert_kernel_matches(fused_cpu.linear_amx_w8(x, quant.tiles(q2), s2), ref2)
        with kernel_build.suspended():
            _assert_kernel_matches(quant.linear_int8(x, q, s, None, bias), ref)


def _tensors_in(obj: object) -> list[torch.Tensor]:
    """Every tensor an object's attributes hold, one level into tuples, lists and dataclasses (a test's own walk,
    independent of `weight_bytes`)."""
    import dataclasses

    found: list[torch.Tensor] = []
    for v in vars(obj).values() if hasattr(obj, "__dict__") else ():
        items = list(v) if isinstance(v, (tuple, list)) else [v]
        for it in items:
            if dataclasses.is_dataclass(it) and not isinstance(it, type):
                items += [getattr(it, f.name) for f in dataclasses.fields(it)]
            elif isinstance(it, torch.Tensor):
                found.append(it)
    return found


def _storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        try:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        except (RuntimeError, NotImplementedError):
            seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


@pytest.mark.parametrize("scheme", [None, "int8", "w8a8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_bytes_count_every_copy_of_the_base_weights_the_model_and_runner_hold(dtype, scheme):
    """After a prefill and a decode step through the runner (the kernels' copies made), `weight_bytes` equals the
    bytes of every tensor the model's parameters, its quantized linears (buffers and attributes) and the runner's
    packed linears hold, each storage once; an int8 base keeps one int8 copy of each weight, in the layout its
    kernel reads (tiles for bfloat16 on AMX), with the same outputs as the rows it was quantized to."""
    from molora.ops import fused_cpu

    if scheme == "w8a8" and dtype == torch.bfloat16:
        pytest.skip("w8a8 runs float32 here")
    mm = molora.attach(tiny_model("llama"), {}, quantization=scheme)
    mm.to(dtype)
    runner = ModelRunner(mm, num_blocks=16, block_size=4, max_model_len=64, pack_weights=True)
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        runner(ids.reshape(-1), torch.arange(6).repeat(2), BatchMeta([6, 6], [6, 6], [[0, 1], [2, 3]]),
               StepRouting(torch.full((12, 1), -1)), logits=True)  # fmt: skip
        runner(torch.tensor([5, 6]), torch.tensor([6, 6]), BatchMeta([1, 1], [7, 7], [[0, 1], [2, 3]]),
               StepRouting(torch.full((2, 1), -1)), logits=True)  # fmt: skip
    quantized = [m for m in mm.modules() if isinstance(m, QuantizedLinear)]
    held = list(mm.model.parameters()) + runner.packed_weights()
    for m in quantized:
        held += [t for t in (m.qweight, m.scales, m.smooth) if t is not None] + _tensors_in(m)
    wb = weight_bytes(mm.model, runner.packed_weights())
    assert sum(wb.values()) == _storage_bytes(held)
    if scheme != "int8":
        return
    int8 = [t for m in quantized for t in [m.qweight, *_tensors_in(m)] if t.dtype == torch.int8]
    assert sum(t.numel() for t in int8) == sum(m.in_features * m.out_features for m in quantized)  # one copy
    m = quantized[0]
    tiled = dtype == torch.bfloat16 and fused_cpu.w8_amx()
    assert m.tiled == tiled and m.qweight.dim() == (4 if tiled else 2)
    x = torch.randn(5, m.in_features, generator=torch.Generator().manual_seed(4)).to(dtype)
    q, s = m.rows(), m.scales.float()
    assert m.state_dict()["qweight"].shape == (m.out_features, m.in_features)
    with torch.no_grad():
        assert torch.equal(m(x), quant.linear_int8(x, q, s, quant.tiles(q) if tiled else None, m.bias))
        m(x.float())  # another dtype: back to rows, the same values
    assert not m.tiled and torch.equal(m.qweight, q)


def test_the_retention_decomposition_says_when_the_loss_is_not_routing(tmp_path):
    """tools/make_quant.py reads experiments/quant_retention.py's record: a variant whose routed run put no answer token
    on an adapter and whose identical-batch retention is full loses its engine retention to batch noise, not to
    routing; one token on an adapter, or a lower same-batch figure, and it says nothing of the kind."""
    import json

    from tests.conftest import load_script

    mq = load_script("make_quant")
    assert mq.retention_lines(tmp_path) == [] and mq.retention_cell(tmp_path) is None

    def variant(tokens: int, same: float) -> dict:
        return {"engine_retention": 75.0, "engine_adapter_tokens": tokens, "engine_routed_tokens": 3000,
                "engine_base_repeat": 80.0, "same_batches_retention": same}  # fmt: skip

    rec = {
        "command": "python -m experiments.quant_retention --split test2",
        "date": "2026-12-04",
        "split": "test2",
        "n_general": 60,
        "machine": {"cpu": "CPU", "threads": 1},
        "variants": {"w8a8": variant(0, 100.0), "bf16": variant(3, 100.0), "int8": variant(0, 90.0)},
    }
    (tmp_path / mq.RETENTION_RECORD).write_text(json.dumps(rec))
    v = rec["variants"]
    assert mq._is_noise(v["w8a8"]) and not mq._is_noise(v["bf16"]) and not mq._is_noise(v["int8"])
    assert "| w8a8 | 75.0% | 0 of 3000 | 80.0% | 100.0% |" in mq.retention_lines(tmp_path)
    assert "w8a8 75% / 0 / 80% / 100%" in mq.retention_cell(tmp_path)
    assert "60 general prompts of test2" in mq.retention_cell(tmp_path)
    assert "below 100% (w8a8) is the base's own answers moving with the batch" in mq.retention_cell(tmp_path)
    more = rec | {"variants": {"int8-bf16-qhead": variant(0, 100.0)}}  # a second record of more variants
    (tmp_path / mq.RETENTION_MORE).write_text(json.dumps(more))
    assert mq._is_noise(more["variants"]["int8-bf16-qhead"])
    assert "(w8a8, int8-bf16-qhead)" in mq.retention_cell(tmp_path)
    assert "| int8-bf16-qhead | 75.0% | 0 of 3000 | 80.0% | 100.0% |" in mq.retention_lines(tmp_path)


def test_the_peer_goals_are_read_off_the_int8_head_record(tmp_path):
    """The three peer goals together (>= 1.0x llama.cpp without adapters, >= 1.3x with a LoRA, weights within
    1.5x of the GGUF's bytes), read per variant of the int8-qhead peer record; each bound is inclusive."""
    import json

    from tests.conftest import load_script

    mq = load_script("make_quant")
    assert mq.peer_goal_cell(tmp_path) is None

    def variant(plain: float, lora: float, weights: int) -> dict:
        return {"llama_over_molora": [plain, plain], "llama_over_molora_lora": [lora, lora],
                "molora": {"weight_bytes": weights}, "llama.cpp": {"gguf_type": "Q8_0", "file_bytes": 100}}  # fmt: skip

    rec = {
        "machine": {"cpu": "CPU"},
        "llama_cpp": {"n_threads": 2},
        "variants": {"int8-qhead": variant(1.0, 1.3, 150), "int8": variant(1.3, 1.5, 230)},
    }
    (tmp_path / mq.PEER_QHEAD).write_text(json.dumps(rec))
    cell = mq.peer_goal_cell(tmp_path)
    assert "int8-qhead vs Q8_0 1.00x (1.30x with a LoRA; weights 1.50x the GGUF's: the three peer goals met)" in cell
    assert "int8 vs Q8_0 1.30x (1.50x with a LoRA; weights 2.30x the GGUF's: the three peer goals not all met)" in cell


def test_the_w8a8_probe_records_render_one_row_per_variant(tmp_path):
    """tools/make_quant.py's table of experiments/w8a8_keep_probe.py's records: every variant a row, every set a
    top-1 and a KL column; nothing while no record exists."""
    import json

    from tests.conftest import load_script

    mq = load_script("make_quant")
    assert mq.keep_lines(tmp_path) == []
    cell = {"top1_agreement": 0.99, "kl_per_position": 0.00344, "positions": 10}
    rec = {
        "command": "python -m experiments.w8a8_keep_probe --json x",
        "date": "2026-12-04",
        "machine": {"cpu": "CPU"},
        "n": 48,
        "variants": {
            "w8a8": {"arithmetic": cell, "general": cell},
            "w8a8 keep down_proj": {"arithmetic": cell, "general": cell},
        },
    }
    (tmp_path / mq.KEEP_RECORDS[0]).write_text(json.dumps(rec))
    lines = mq.keep_lines(tmp_path)
    assert "| variant | arithmetic top-1 | arithmetic KL | general top-1 | general KL |" in lines
    assert "| w8a8 keep down_proj | 0.9900 | 0.00344 | 0.9900 | 0.00344 |" in lines
