"""Which projections cost w8a8 its arithmetic: each of the seven kept in weight-only int8 (float activations) in turn,
the rest in w8a8, teacher-forced on validation items against float32.

    .venv/bin/python -m experiments.w8a8_keep_probe --json docs/quant_w8a8_keep_val.json [--n 48] [--threads 2]
        [--keep down_proj gate_proj,up_proj,down_proj]

w8a8 (int8 weights and per-token int8 activations on torch._int_mm, SmoothQuant on the rows molora.load reads) lost
arithmetic on test2 (-11 points, docs/quant_eval_test2_w8a8.json) where weight-only int8 did not (-3). Here, on the
default bundle, float32 first answers --n validation items of multistep_arithmetic_two on the arithmetic adapter and
--n general validation prompts on the base model, greedily (molora.prompts.generate_batch); then each variant reads
the same prompts + float32's answers in one teacher-forced forward on the same adapter (or none), and the record
keeps, per variant and per set, the share of answer positions whose argmax equals float32's answer token
(top-1 agreement) and the mean KL(float32 || variant) per answer position. Variants: w8a8 (every projection), int8
(every projection weight-only), and w8a8 with the projections of each --keep entry (comma-separated last names) in
weight-only int8 (default: each of the seven alone), and w8a8 with down_proj's SmoothQuant strength at each
--down-alpha (the others at SMOOTH_ALPHA). Validation only: nothing here is scored on test; a choice made
from it is scored on a fresh split once, later. The mixed variants are built here by quantizing in two passes
(experiments/bench_quant.py's quantize_keeping: w8a8 with `skip`, then the rest as int8) before the adapters attach:
not a served option yet.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from experiments.bench_quant import quantize_keeping  # (w8a8 with some projections weight-only, as the bench builds it)

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def main(argv: list[str] | None = None) -> int:
    import importlib

    import torch
    import torch.nn.functional as F

    from molora.bench.common import machine_info
    from molora.bundle import default_bundle_dir, encode_prompt, load, read_bundle, stop_ids
    from molora.data.general import general_split
    from molora.eval.heldout import fingerprint, held_out, training_inputs
    from molora.eval.runner import MAX_NEW_TOKENS
    from molora.eval.tasks import answer_kind
    from molora.prompts import generate_batch
    from molora.routing import SequenceRouter

    attach_mod = importlib.import_module("molora.model.attach")  # the module (molora.model exports attach, a function)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keep", nargs="*", default=list(PROJECTIONS))
    ap.add_argument(
        "--down-alpha", nargs="*", type=float, default=[], help="also w8a8 with down_proj smoothed at each alpha"
    )
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    ref = load(None)
    items, _ = held_out("multistep_arithmetic_two", a.n, training_inputs(ref.bundle), split="val")
    budget = MAX_NEW_TOKENS[answer_kind(items[0].task, items[0].target)]
    sets = {  # name -> (the adapter it runs on, None: the base model; (prompt ids, answer budget) per row)
        "arithmetic": ("arithmetic", [(encode_prompt(ref, it.input), budget) for it in items]),
        "general": (None, [(encode_prompt(ref, r["prompt"]), 64) for r in general_split()["val"][: a.n]]),
    }
    stops = stop_ids(ref)
    seqs: dict[str, list[tuple[list[int], list[int]]]] = {}
    for name, (adapter, rows) in sets.items():
        spec = adapter if adapter is not None else SequenceRouter(None)
        for i in range(0, len(rows), 16):
            chunk = rows[i : i + 16]
            answers, _ = generate_batch(ref, [p for p, _ in chunk], spec, [n for _, n in chunk], stops)
            seqs.setdefault(name, []).extend((p, list(ans)) for (p, _), ans in zip(chunk, answers))

    @torch.no_grad()
    def logits(mm) -> dict[str, list[torch.Tensor]]:  # noqa: ANN001
        out: dict[str, list[torch.Tensor]] = {}
        for name, pairs in seqs.items():
            got = []
            for p, ans in pairs:
                if not ans:
                    continue
                ids = torch.tensor([p + ans])
                adapter = sets[name][0]
                which = -1 if adapter is None else mm.adapter_names.index(adapter)
                lg = mm(ids, adapter_ids=torch.full_like(ids, which), use_cache=False).logits[0, len(p) - 1 : -1]
                lg = lg.float()
                got.append(lg)
            out[name] = got
        return out

    base = logits(ref)
    del ref
    real = attach_mod.quantize_linears

    def variant(keep: tuple[str, ...] | None, scheme: str, down_alpha: float | None = None) -> dict:
        def two_pass(model, q, **kw):  # noqa: ANN001, ANN003  (attach's call, w8a8 with `keep` weight-only)
            return quantize_keeping(model, keep, kw.get("act_amax"))

        def down_smoothed(model, q, **kw):  # noqa: ANN001, ANN003  (down_proj in w8a8 at its own alpha)
            names = real(model, q, skip=("lm_head", "down_proj"), **kw)
            others = tuple(p for p in PROJECTIONS if p != "down_proj")
            return names + real(model, q, skip=("lm_head", *others), act_amax=kw.get("act_amax"), alpha=down_alpha)

        patched = two_pass if keep else down_smoothed if down_alpha is not None else real
        attach_mod.quantize_linears = patched  # type: ignore[assignment]
        try:
            mm = load(None, quantization=scheme)
        finally:
            attach_mod.quantize_linears = real  # type: ignore[assignment]
        got = logits(mm)
        res = {}
        for name in seqs:
            agree, kl, n = 0, 0.0, 0
            for lb, lv in zip(base[name], got[name]):
                agree += int((lb.argmax(-1) == lv.argmax(-1)).sum())
                kl += float(F.kl_div(lv.log_softmax(-1), lb.log_softmax(-1), log_target=True, reduction="sum"))
                n += lb.shape[0]
            res[name] = {"top1_agreement": round(agree / n, 4), "kl_per_position": round(kl / n, 5), "positions": n}
        print(scheme, keep, down_alpha, json.dumps(res), flush=True)
        return res

    variants = {"w8a8": variant(None, "w8a8"), "int8": variant(None, "int8")}
    for k in a.keep:
        keep = tuple(k.split(","))
        bad = [x for x in keep if x not in PROJECTIONS]
        if bad:
            raise SystemExit(f"--keep {k}: unknown projections {bad}; known: {', '.join(PROJECTIONS)}")
        variants[f"w8a8 keep {k}"] = variant(keep, "w8a8")
    for x in a.down_alpha:
        variants[f"w8a8 down_proj alpha={x}"] = variant(None, "w8a8", down_alpha=x)
    rec = {
        "command": "python -m experiments.w8a8_keep_probe " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info() | {"threads": a.threads},
        "fingerprint": fingerprint(read_bundle(default_bundle_dir())),
        "split": "val",
        "n": a.n,
        "teacher": "float32, greedy: arithmetic on its adapter, general on the base model",
        "variants": variants,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    a.json.write_text(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
