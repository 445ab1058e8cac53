"""Choose int8's SmoothQuant strength on validation text: the quantized base's next-token agreement with float32.

    python -m experiments.quant_smooth_choose [--rows 24] [--json docs/quant_smooth_choice.json]

The default base (SmolLM2-135M) in float32 reads --rows general prompts of the validation split (molora.data.general:
Self-Instruct and GSM8K, never the test split), each with its reference answer, in the chat template the bundle uses
(teacher forced). The same model with its linears quantized to int8 (molora.model.quant_linear, W8A8, activations
rounded per token) reads them again, for each SmoothQuant strength alpha (none: activations rounded unsmoothed); the
activation ranges come from the rows `molora.load` calibrates on (train split, bundle.QUANT_CALIBRATION_ROWS). Per
variant: the share of positions whose top-1 token equals float32's, and the mean KL(fp32 || variant) per position;
bfloat16 beside them for scale. The chosen alpha is the one with the lowest KL (ties: the higher agreement); it is
what molora.ops.quant.SMOOTH_ALPHA holds.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    from molora.bundle import CHATML_TEMPLATE, quant_calibration_rows
    from molora.data.general import general_rows
    from molora.model.base import load_default_base
    from molora.model.quant_linear import activation_ranges, quantize_linears

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=24)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--alphas", type=float, nargs="+", default=[0.3, 0.5, 0.7, 0.85])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    model, tok = load_default_base(torch.float32)
    model.eval()
    rows = [r[: args.max_len] for r in general_rows(tok, args.rows, CHATML_TEMPLATE, with_output=True, split="val")]
    calib = quant_calibration_rows(tok)
    amax = activation_ranges(model, calib)

    def logits(m: torch.nn.Module) -> list[torch.Tensor]:
        with torch.no_grad():
            return [m(torch.tensor([r])).logits[0].float() for r in rows]

    ref = logits(model)

    def score(m: torch.nn.Module) -> dict[str, float]:
        agree = kl = 0.0
        n = 0
        for lo, lr in zip(logits(m), ref):
            agree += (lo.argmax(-1) == lr.argmax(-1)).sum().item()
            kl += torch.nn.functional.kl_div(
                lo.log_softmax(-1), lr.log_softmax(-1), log_target=True, reduction="sum"
            ).item()
            n += lr.shape[0]
        return {"top1_agreement": agree / n, "kl_per_position": kl / n}

    variants: dict[str, dict] = {"bf16": score(copy.deepcopy(model).to(torch.bfloat16))}
    print("bf16", variants["bf16"], flush=True)
    for alpha in [None, *args.alphas]:
        m = copy.deepcopy(model)
        quantize_linears(m, "int8", act_amax=amax if alpha is not None else None, alpha=alpha or 0.0)
        name = "int8" if alpha is None else f"int8 alpha={alpha}"
        variants[name] = {"alpha": alpha, **score(m)}
        print(name, variants[name], flush=True)
    smoothed = {k: v for k, v in variants.items() if k.startswith("int8 alpha")}
    best = min(smoothed, key=lambda k: (smoothed[k]["kl_per_position"], -smoothed[k]["top1_agreement"]))
    record = {
        "what": "int8 (W8A8) next-token agreement with float32 on validation general text, by SmoothQuant alpha",
        "command": "python -m experiments.quant_smooth_choose " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "loadavg": os.getloadavg(),
            "threads": args.threads,
        },
        "rows": len(rows),
        "positions": sum(len(r) for r in rows),
        "split": "val (molora.data.general.general_split)",
        "calibration_rows": len(calib),
        "variants": variants,
        "chosen_alpha": smoothed[best]["alpha"],
    }
    print(json.dumps(record))
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
