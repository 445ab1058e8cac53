"""lm-eval's log-likelihood (multiple choice) through `molora serve` against lm-eval's own `hf` model, same weights.

Writes docs/lm_eval_parity.json. Command (from the repository root):

    .venv/bin/python experiments/lm_eval_parity.py            # --items 100 --port 8765 --batch-size 8

What it does: builds multiple-choice items from GSM8K test problems (/work/shared/data/gsm8k/test.jsonl, from
openai/grade-school-math, MIT; see /work/shared/data/SOURCES.md): the context "Question: <question>\\nAnswer: The
answer is", four continuations " <number>": the problem's final answer (after "####", commas dropped) and three
final answers of other test problems, drawn and shuffled by random.Random(0). No hub, no download: lm-eval's own
datasets are not reachable here, so the same `Instance`s go straight to both models' `loglikelihood`:
  - `hf`: lm_eval.models.huggingface.HFLM over the transformers model loaded in float32 from the weights
    `molora setup-default` cached (~/.cache/molora/SmolLM2-135M-Instruct, or $MOLORA_CACHE);
  - `local-completions`: lm_eval.models.openai_completions.LocalCompletionsAPI against `molora serve --model
    <those weights> --dtype float32` (token-id prompts, batches of --batch-size, echo=true, logprobs=1,
    max_tokens=1: what lm-eval sends), so the served base model scores the prompt through the engine.
It records the largest and mean absolute difference of the per-choice log-likelihoods, each model's accuracy,
how many items pick the same choice, and how many is_greedy flags agree. Target: within 1e-3, identical choices.

Needs lm-eval and tenacity in the venv (`.venv/bin/pip install lm-eval tenacity`; an experiment, not a
dependency of molora). The server is started and stopped here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
DATA = Path("/work/shared/data/gsm8k/test.jsonl")
OUT = ROOT / "docs" / "lm_eval_parity.json"
SERVED = "smollm2"


def weights_dir() -> Path:
    from molora.model.base import DEFAULT_BASE_NAME, cache_root

    path = cache_root() / DEFAULT_BASE_NAME.rsplit("/", 1)[-1]
    if not (path / "config.json").is_file():
        sys.exit(f"no cached weights at {path}: run `molora setup-default` first")
    return path


def build_items(n: int) -> list[dict]:
    """n items: context, four choices, the index of the true one (module docstring)."""
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    answers = [r["answer"].rsplit("####", 1)[1].strip().replace(",", "") for r in rows]
    rng = random.Random(0)
    items = []
    for i in range(n):
        pool = sorted({a for a in answers if a != answers[i]})
        choices = [answers[i]] + rng.sample(pool, 3)
        rng.shuffle(choices)
        items.append(
            {
                "context": f"Question: {rows[i]['question']}\nAnswer: The answer is",
                "choices": [f" {c}" for c in choices],
                "gold": choices.index(answers[i]),
            }
        )
    return items


def instances(items: list[dict]) -> list:
    from lm_eval.api.instance import Instance

    out = []
    for i, item in enumerate(items):
        for j, choice in enumerate(item["choices"]):
            out.append(Instance("loglikelihood", {"item": i}, (item["context"], choice), idx=j))
    return out


def start_server(weights: Path, port: int) -> subprocess.Popen:
    cmd = [str(Path(sys.executable).parent / "molora"), "serve", "--model", str(weights)]
    cmd += ["--served-model-name", SERVED, "--dtype", "float32", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"molora serve exited ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.terminate()
    raise RuntimeError("molora serve did not become healthy in 600 s")


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return re.search(r"Model name:\s*(.+)", out).group(1).strip()
    except (OSError, subprocess.CalledProcessError, AttributeError):
        return platform.processor() or "unknown"


def accuracy(items: list[dict], lls: list[float]) -> tuple[float, list[int]]:
    picks = [max(range(4), key=lambda j, i=i: lls[4 * i + j]) for i in range(len(items))]
    return sum(p == it["gold"] for p, it in zip(picks, items)) / len(items), picks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=100, help="multiple-choice items (4 choices each)")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--batch-size", type=int, default=8, help="requests per batch, both models")
    args = ap.parse_args()
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from transformers import AutoModelForCausalLM, AutoTokenizer

    weights = weights_dir()
    items = build_items(args.items)
    reqs = instances(items)

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(weights)
    hf = HFLM(pretrained=model, tokenizer=tok, batch_size=args.batch_size)
    hf_out = hf.loglikelihood(reqs)
    hf_s = time.perf_counter() - t0
    del hf, model

    proc = start_server(weights, args.port)
    try:
        t0 = time.perf_counter()
        api = LocalCompletionsAPI(
            base_url=f"http://127.0.0.1:{args.port}/v1/completions",
            model=SERVED,
            tokenizer=str(weights),
            tokenizer_backend="huggingface",
            tokenized_requests=True,
            batch_size=args.batch_size,
            max_retries=1,
        )
        api_out = api.loglikelihood(reqs)
        api_s = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    hf_ll = [float(ll) for ll, _ in hf_out]
    api_ll = [float(ll) for ll, _ in api_out]
    diffs = [abs(a - b) for a, b in zip(hf_ll, api_ll)]
    hf_acc, hf_picks = accuracy(items, hf_ll)
    api_acc, api_picks = accuracy(items, api_ll)
    same = sum(a == b for a, b in zip(hf_picks, api_picks))
    greedy_agree = sum(bool(a[1]) == bool(b[1]) for a, b in zip(hf_out, api_out))
    record = {
        "what": "lm-eval loglikelihood through molora serve (local-completions) against lm-eval's hf model, "
        "same SmolLM2-135M-Instruct weights, float32",
        "command": " ".join(["python experiments/lm_eval_parity.py", *sys.argv[1:]]),
        "data": "GSM8K test (openai/grade-school-math, MIT): the first "
        f"{args.items} problems, true final answer + 3 other problems' answers, random.Random(0)",
        "cpu": cpu_name(),
        "torch_threads": torch.get_num_threads(),
        "versions": {"lm_eval": lm_eval.__version__, "torch": torch.__version__},
        "items": args.items,
        "requests": len(reqs),
        "max_abs_diff": max(diffs),
        "mean_abs_diff": sum(diffs) / len(diffs),
        "accuracy": {"hf": hf_acc, "local_completions": api_acc},
        "same_choice_items": same,
        "is_greedy_agree": greedy_agree,
        "target": {"max_abs_diff_below": 1e-3, "same_choice_items": args.items},
        "meets_target": max(diffs) < 1e-3 and same == args.items,
        "seconds": {"hf": round(hf_s, 1), "local_completions": round(api_s, 1)},
        "date": time.strftime("%Y-%m-%d"),
    }
    OUT.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
