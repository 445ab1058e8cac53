"""tools/gpu_check.py, the prepared device check: its CPU dry run goes end to end and reports every
section honestly; without CUDA the real run refuses with a clear message."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
MODULE = "tools.gpu_check"


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-m", MODULE, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_the_real_run_says_why_and_exits_2() -> None:
    proc = _run("--device", "cuda", timeout=120)
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr and "--dry-run" in proc.stderr
    assert proc.stdout == ""


@pytest.mark.slow
def test_the_dry_run_goes_end_to_end(tmp_path) -> None:
    proc = _run("--dry-run", "--json", str(tmp_path / "check.json"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == json.loads((tmp_path / "check.json").read_text())
    has_triton = importlib.util.find_spec("triton") is not None
    assert has_triton or os.environ.get("MOLORA_REQUIRE_TRITON") != "1", "make test-triton: triton is not installed"
    assert out["errors"] == ({} if has_triton else {"triton": out["errors"]["triton"]})
    backends = {r["backend"] for r in out["exactness"]}
    assert backends == ({"triton", "stacked_mask"} if has_triton else {"stacked_mask"})
    for r in out["exactness"]:  # float32 tight; bf16 / fp16 within their rounding
        assert r["rel_err"] < (1e-5 if r["dtype"] == "float32" else 2e-2), r
    assert {r["T"] for r in out["dispatch"]} == {1, 8, 64} and {r["K"] for r in out["dispatch"]} == {4, 16}
    assert all(r["ms"]["single"] > 0 for r in out["dispatch"])
    decode = out["decode"]["tiny"]
    assert decode["eager_ms"] > 0 and decode["graph"]["status"] == "not run"  # graphs: CUDA only
    assert out["engine"]["sequences"] == 8 and out["engine"]["seconds"]["engine"] > 0
    assert "not_judged" in out["goals"]


def test_the_graph_check_replays_against_eager_on_the_cpu_emulator(tmp_path) -> None:
    """check_graph, the decode section's graph part, run on the CPU through the test emulator (what a CUDA graph
    would replay): every replay equals eager, per-token and learned routing, an adapter unloaded in between."""
    import molora
    from molora.bench.engine import make_adapters
    from molora.model.batch import BatchMeta, StepRouting
    from molora.model.runner import ModelRunner
    from tests.conftest import load_script
    from tests.graph_emulator import emulated_capture

    gc = load_script("gpu_check")
    model = gc.qwen3(gc.TINY_SHAPE, torch.device("cpu"), torch.float32)
    mm = molora.attach(model, make_adapters(model, tmp_path, 4, 4), slots=4, dispatch="stacked_mask")
    mm.dispatcher.check_ids = False
    batch, ctx, bs = 3, 10, 16
    runners = [ModelRunner(mm, num_blocks=batch, block_size=bs, max_model_len=bs) for _ in range(2)]
    tables = [[b] for b in range(batch)]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 256, (batch * ctx,), generator=g)
    slots = torch.randint(-1, 4, (batch * ctx, 1), generator=g)
    with torch.no_grad():
        for r in runners:
            r(
                prompt,
                torch.arange(ctx).repeat(batch),
                BatchMeta([ctx] * batch, [ctx] * batch, tables),
                StepRouting(slots),
            )
        out = gc.check_graph(
            runners[0],
            runners[1],
            mm,
            torch.randint(3, 256, (batch,), generator=g),
            torch.full((batch,), ctx),
            BatchMeta([1] * batch, [ctx + 1] * batch, tables),
            torch.randint(-1, 4, (batch, 1), generator=g),
            4,
            capture=emulated_capture,
        )
    assert out["status"] == "replayed" and out["captures"] == 2, out
    assert max(out["max_abs_logit_diff_vs_eager"] + out["learned_max_abs_logit_diff_vs_eager"]) < 1e-4, out
