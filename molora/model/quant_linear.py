"""`QuantizedLinear`: a weight-only int8 or int4 base linear, and the walk-and-swap that quantizes a model.

    names = quantize_linears(model, "int8")     # every nn.Linear of the decoder blocks -> QuantizedLinear
    y = layer(x)                                 # x [..., d_in] float32 / bfloat16 -> [..., d_out], x's dtype

The weight is quantized once, on load (molora.ops.quant: int8 and w8a8 symmetric per output channel, int4 asymmetric
groups of 32 along d_in), and the float weight is dropped: the module holds `qweight` (int8 [d_out, d_in], or
torch's packed int4 bytes) and `scales` (float, the model's dtype: `model.to(torch.bfloat16)` casts them with the
rest) as buffers. int8 is weight only: the activations stay in the model's dtype, on molora's int8 kernels
(`quant.linear_int8`; the scales widened to float32 once, made again when they change; `w8_operands` hands the
operands to the runner's one-call decode block). One int8 copy of the weight is kept: for bfloat16 activations on
AMX qweight itself is turned into the tiles' layout (`tiled`; prefill and decode both read the tiles), rows again at
a call in another dtype; `rows` gives the rows to the paths that need them (the state dict holds rows). Measured
against keeping rows and tiles both (experiments/ab_engine_trees.py --quantization int8, docs/quant_w8_onecopy_ab.json):
no slower. `weight_bytes` counts every resident copy of the base weights, the kernels' copies included.
w8a8 runs on qweight itself (torch._int_mm on a transposed view; float32 scales made at the first call, again when
qweight, scales or smooth change) with the activations quantized per token (molora.ops.quant), each input channel
first multiplied by `smooth` when the layer was built with activation ranges (SmoothQuant, power-of-two factors;
`activation_ranges` measures them, molora.load reads general text for it). The LM head (tied to the embeddings in
small models) stays in float by default. `quantize_head` (attach's quantize_lm_head=True) makes it an int8
`QuantizedLinear` too (under w8a8 a w8a8 one, unsmoothed: the final hidden state rounded per token), and the tied
input embeddings a `QuantizedEmbedding` that reads the rows of the same int8 copy: no float [V, D] matrix and no
packed copy of it is left (SmolLM2-135M under int8: 135 MB of base weights, 0.94x the Q8_0 GGUF, against 333 MB in
float32 and 164 MB (220 MB on AMX, which packs a bfloat16 copy of the head) in bfloat16 with the head in float;
docs/quant_weight_bytes.json). Not the default (HEAD_SCHEMES empty): on validation it kept every float32-activation
skill item's score, but in bfloat16 general retention fell from 90% to 80% (docs/quant_eval_val_head.json), and the
engine ran 6-11% slower with it on an AVX-512 CPU without AMX (linear_w8 on the head against the float32 panels or
torch's bfloat16 GEMM; docs/quant_head_ab.json, and 6-9% with the trees swapped, docs/quant_head_ab_swapped.json).
Under w8a8 the head in w8a8 ran no faster (1.51x float32 against 1.54x without it, docs/quant_w8a8_head_noamx.json)
and lost on validation (navigate -16.7 points, retention 77.5% against 82.5%, docs/quant_eval_val_w8a8_head.json):
off by default too, for its memory only. A `RoutedLoRALinear` wraps a `QuantizedLinear` as it wraps an `nn.Linear`:
the LoRA delta stays in the activation dtype, unquantized.

With autograd on (training adapters over a quantized base) the product runs on the dequantized weight, which
autograd differentiates with respect to x; the weight itself is frozen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from molora.ops import quant

# schemes that quantize the LM head by default (`quantize_head`): none, chosen on validation (module docstring)
HEAD_SCHEMES: tuple[str, ...] = ()
# schemes whose LM head can be quantized (`quantize_head`): both keep int8 rows [V, D] the embeddings can read
HEAD_CAPABLE: tuple[str, ...] = ("int8", "w8a8")


class QuantizedLinear(nn.Module):
    """y = x @ dequantize(qweight, scales).T + bias on the scheme's CPU kernel (module docstring)."""

    qweight: Tensor  # buffers, typed here (nn.Module.__getattr__ would type them `Tensor | Module`)
    scales: Tensor
    smooth: Tensor | None
    bias: Tensor | None

    def __init__(
        self,
        base: nn.Linear,
        scheme: str,
        group: int = quant.INT4_GROUP,
        act_amax: Tensor | None = None,
        alpha: float = quant.SMOOTH_ALPHA,
    ) -> None:
        super().__init__()
        quant.check_scheme(scheme)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.scheme, self.group = scheme, group if scheme == "int4" else 0
        weight, smooth = base.weight, None
        if scheme == "w8a8" and act_amax is not None:  # SmoothQuant (module docstring)
            if act_amax.shape != (self.in_features,):
                raise ValueError(f"act_amax must have one value per input channel ({self.in_features})")
            s = quant.smoothing(act_amax, weight, alpha)
            weight, smooth = weight.detach().float() * s, 1 / s
        q, scales = quant.quantize(weight, scheme, group)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales.to(base.weight.dtype))
        self.register_buffer("smooth", smooth)  # w8a8 with calibration: x's factor per channel (powers of two)
        self.bias = base.bias
        self._packed: tuple | None = None  # w8a8: (key, quant.W8A8Weight); int8: (key, float32 scales)
        self.tiled = False  # int8: qweight is held in the AMX tiles' layout (`w8_operands`), not as rows
        # chosen once: forward never branches on the scheme; (x, bias) -> x @ W.T + bias
        self._kernel = {"int8": self._int8, "w8a8": self._w8a8, "int4": self._int4}[scheme]

    def __getstate__(self) -> dict:  # copies and pickles drop the packed copies (made again at the next call)
        return {**self.__dict__, "_packed": None}

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled() and x.requires_grad:  # autograd: the dequantized weight (module docstring)
            return F.linear(x, self.dequantized().to(x.dtype), self.bias)
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # [T, d_in]
        y = self._kernel(flat.contiguous(), self.bias)  # [T, d_out]
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def w8_operands(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """int8: (the weight as the kernel for activations of `dtype` takes it, float32 scales [d_out]). One copy of
        the int8 weight is kept, in the layout its kernel reads: for bfloat16 on AMX (`fused_cpu.w8_amx`, d_out a
        multiple of 16, d_in of 32) qweight is turned, in place of the rows, into the int8 tiles
        [d_out / 16, d_in / 32, 16, 32] (`quant.tiles`; `tiled` says so) at the first such call, and back into rows
        [d_out, d_in] at the first call in another dtype. The paths that need rows while tiled (kernels declined or
        off, autograd, `dequantized`, the state dict) take them from the tiles (`rows`: a copy). The float32 scales
        are made again when scales change (their address or version)."""
        assert self.scheme == "int8", self.scheme
        from molora.ops import fused_cpu

        n, k = self.out_features, self.in_features
        tile = dtype == torch.bfloat16 and n % 16 == 0 and k % 32 == 0
        if tile != self.tiled and (not tile or fused_cpu.w8_amx()):
            with torch.no_grad():
                self.qweight = quant.tiles(self.qweight) if tile else quant.untile(self.qweight)
            self.tiled = tile
        s = self.scales
        key = (s.data_ptr(), s._version)
        if self._packed is None or self._packed[0] != key:
            self._packed = (key, s.float().contiguous())
        return self.qweight, self._packed[1]

    def rows(self) -> Tensor:
        """The quantized weight as `quant.quantize` made it (int8: [d_out, d_in]; a copy where `tiled`)."""
        return quant.untile(self.qweight) if self.tiled else self.qweight

    def take(self, ids: Tensor) -> Tensor:
        """int8 / w8a8: the weight rows (output channels) `ids` [T] as int8 [T, d_in], from whichever layout is kept
        (the tiles gathered in place: no copy of the whole weight)."""
        assert self.scheme in HEAD_CAPABLE, self.scheme
        return quant.take_tiles(self.qweight, ids) if self.tiled else self.qweight.index_select(0, ids)

    def _int8(self, x: Tensor, bias: Tensor | None) -> Tensor:  # the bias added in the kernel, before its rounding
        w, s32 = self.w8_operands(x.dtype)
        return quant.linear_int8(x, None if self.tiled else w, s32, w if self.tiled else None, bias)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.tiled:  # the state dict holds rows, whatever layout the kernel keeps
            destination[prefix + "qweight"] = self.rows()

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: object) -> None:
        if self.tiled:  # rows come in: the layout is made again at the next call
            with torch.no_grad():
                self.qweight = self.rows()
            self.tiled = False
        super()._load_from_state_dict(state_dict, prefix, *args)

    def _w8a8(self, x: Tensor, bias: Tensor | None) -> Tensor:
        q, s, m = self.qweight, self.scales, self.smooth
        key = (q.data_ptr(), q._version, s.data_ptr(), s._version, None if m is None else (m.data_ptr(), m._version))
        if self._packed is None or self._packed[0] != key:
            self._packed = (key, quant.prepack_w8a8(q, s.float(), m))
        y = quant.linear_w8a8(x, self._packed[1])
        return y if bias is None else y.add_(bias)

    def _int4(self, x: Tensor, bias: Tensor | None) -> Tensor:
        y = quant.linear_int4(x, self.qweight, self.scales, self.group)
        return y if bias is None else y.add_(bias)

    def _reference_kernel(self, x: Tensor, bias: Tensor | None) -> Tensor:
        """`reference` on 2-D x: what a test puts in place of the kernel (`_kernel`) to run a model on it."""
        return quant.linear_reference(
            x, self.rows(), self.scales, self.scheme, self.group, self.shape, bias, self.smooth
        )

    def reference(self, x: Tensor) -> Tensor:
        """The slow spec of forward: the dequantized float32 weight's product, in x's dtype."""
        flat = x.reshape(-1, self.in_features)
        y = quant.linear_reference(
            flat, self.rows(), self.scales, self.scheme, self.group, self.shape, self.bias, self.smooth
        )
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> Tensor:
        """The float32 weight [d_out, d_in] this layer multiplies by (x's smoothing folded back in)."""
        w = quant.dequantize(self.rows(), self.scales, self.scheme, self.group, self.shape)
        return w if self.smooth is None else w * self.smooth.float()

    def nbytes(self) -> int:
        """Bytes of the quantized weight and its scales (not the bias), as stored (`quant.quantize`'s tensors)."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.smooth) if t is not None)

    def kernel_copies(self) -> list[Tensor]:
        """The tensors this layer keeps for its kernel beside its buffers, now: int8 its float32 scales (the scales
        themselves in a float32 model), w8a8 its float32 scales (the int8 weight is read in place). Made at the
        first call (`weight_bytes` counts them)."""
        if self._packed is None:
            return []
        if self.scheme == "w8a8":
            w = self._packed[1]  # qt is a view of qweight: not a copy
            return [t for t in (w.scales, w.smooth) if t is not None and t is not self.smooth]
        return [self._packed[1]]

    def extra_repr(self) -> str:
        group = f", group={self.group}" if self.scheme == "int4" else ", smooth=True" if self.smooth is not None else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, scheme={self.scheme}{group}"
        )


class QuantizedEmbedding(nn.Module):
    """The input embeddings read from the int8 copy of a tied LM head (`quantize_head`): the rows of the tokens,
    dequantized, so that the embedding and the head hold one int8 copy between them.

        emb = QuantizedEmbedding(head)     # head: the int8 QuantizedLinear [V, D] that replaced the tied lm_head
        h = emb(ids)                       # ids [...] -> [..., D] = qweight[ids] * scales[ids], in the scales' dtype
    """

    head: QuantizedLinear

    def __init__(self, head: QuantizedLinear, padding_idx: int | None = None) -> None:
        super().__init__()
        if head.scheme not in HEAD_CAPABLE or head.smooth is not None:
            raise ValueError(f"embeddings read from an unsmoothed int8 or w8a8 head only, got {head.scheme}")
        self.num_embeddings, self.embedding_dim, self.padding_idx = head.out_features, head.in_features, padding_idx
        # a reference, not a submodule: the model owns the head as lm_head (listed once by named_modules and
        # state_dict, cast once by .to); the embedding reads its buffers at each call
        object.__setattr__(self, "head", head)

    def forward(self, ids: Tensor) -> Tensor:
        flat = ids.reshape(-1)  # [T]
        s = self.head.scales
        rows = quant.dequantize_int8(self.head.take(flat), s.index_select(0, flat))  # [T, D] float32
        return rows.to(s.dtype).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 rows of the tied LM head"


def quantize_head(model: nn.Module, scheme: str) -> list[str]:
    """Swap the LM head (a transformers model's output embeddings, an `nn.Linear`) for a `QuantizedLinear` of
    `scheme` ("int8" or "w8a8", HEAD_CAPABLE; w8a8 rounds the final hidden state per token, unsmoothed) and, where
    it is tied to the input embeddings, the input embeddings for a
    `QuantizedEmbedding` that reads the same int8 copy; the float matrix is dropped. Returns the names replaced
    (none where the model has no plain linear head). Quantize before attaching (molora.attach does)."""
    from molora.model.lora_linear import swap_modules

    if scheme not in HEAD_CAPABLE:
        raise ValueError(f"the LM head is quantized under {' or '.join(HEAD_CAPABLE)} only, got {scheme!r}")
    by_id = {id(m): (n, m) for n, m in model.named_modules()}
    head = by_id.get(id(getattr(model, "get_output_embeddings", lambda: None)()))
    emb = by_id.get(id(getattr(model, "get_input_embeddings", lambda: None)()))
    if head is None or not isinstance(lin := head[1], nn.Linear) or type(lin) is not nn.Linear:
        return []
    q = QuantizedLinear(lin, scheme)
    tied = emb is not None and isinstance(e := emb[1], nn.Embedding) and e.weight is lin.weight
    with torch.no_grad():
        names = swap_modules(model, [head[0]], lambda _n, _old: q)
        if tied:
            assert emb is not None and isinstance(emb[1], nn.Embedding)
            pad = emb[1].padding_idx
            names += swap_modules(model, [emb[0]], lambda _n, _old: QuantizedEmbedding(q, pad))
    return names


def quantize_linears(
    model: nn.Module,
    scheme: str,
    *,
    skip: tuple[str, ...] = ("lm_head",),
    act_amax: dict[str, Tensor] | None = None,
    alpha: float = quant.SMOOTH_ALPHA,
) -> list[str]:
    """Swap every `nn.Linear` of `model` (but those whose last name is in `skip`) for a `QuantizedLinear` of
    `scheme`; return the names replaced. act_amax (w8a8; `activation_ranges`): module name -> its inputs' largest
    magnitude per channel on calibration text, for SmoothQuant with `alpha` (a linear not in it: no smoothing).
    Linears already wrapped by a `RoutedLoRALinear` are not touched: quantize before attaching (molora.attach
    does)."""
    from molora.model.lora_linear import swap_modules

    quant.check_scheme(scheme)
    amax = act_amax or {}
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear and n.rsplit(".", 1)[-1] not in skip]

    def make(name: str, old: nn.Module) -> QuantizedLinear:
        assert isinstance(old, nn.Linear), (name, type(old))  # `names` lists nn.Linear modules only
        return QuantizedLinear(old, scheme, act_amax=amax.get(name), alpha=alpha)

    with torch.no_grad():
        return swap_modules(model, names, make)


def activation_ranges(
    model: nn.Module, rows: Sequence[Sequence[int]], *, skip: tuple[str, ...] = ("lm_head",)
) -> dict[str, Tensor]:
    """Module name -> float32 [d_in]: the largest magnitude each input channel of each `nn.Linear` (but `skip`)
    takes while `model` (a float transformers causal LM) reads each row of token ids, one row per forward."""
    out: dict[str, Tensor] = {}

    def hook(name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(dim=0).float()
            out[name] = x if name not in out else torch.maximum(out[name], x)

        return record

    mods = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear and n.rsplit(".", 1)[-1] not in skip]
    handles = [m.register_forward_pre_hook(hook(n)) for n, m in mods]
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for r in rows:
                model(torch.tensor([list(r)], device=device))
    finally:
        for h in handles:
            h.remove()
    return out


def weight_bytes(model: nn.Module, kernel_copies: Iterable[Tensor] = ()) -> dict[str, int]:
    """Bytes the model's base weights hold now, by kind, each storage counted once: "quantized" (QuantizedLinear
    weights and scales, in the layout they are kept in), "float" (the parameters: embeddings, norms, LM head, float
    base linears), "kernel_copies" (what is kept beside them for the kernels: QuantizedLinear.kernel_copies, and the
    tensors given, e.g. the runner's packed copies of the float weights, `ModelRunner.packed_weights`). Adapter slots
    are buffers: not counted. Kernel copies are made at the first call: count after one."""
    seen: set[int] = set()
    out = {"quantized": 0, "float": 0, "kernel_copies": 0}

    def add(kind: str, t: Tensor) -> None:
        try:
            st = t.untyped_storage()
            key, size = st.data_ptr(), st.nbytes()
        except (
            RuntimeError,
            NotImplementedError,
        ):  # an opaque tensor (e.g. a backend's packed weight): no storage to share
            key, size = id(t), t.numel() * t.element_size()
        if key not in seen and size:
            seen.add(key)
            out[kind] += size

    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    for m in quantized:
        for t in (m.qweight, m.scales, m.smooth):
            if t is not None:
                add("quantized", t)
    for t in model.parameters():
        add("float", t)
    for m in quantized:
        for t in m.kernel_copies():
            add("kernel_copies", t)
    for t in kernel_copies:
        add("kernel_copies", t)
    return out
