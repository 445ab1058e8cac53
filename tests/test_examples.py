"""The examples run as a user runs them (a fresh process from the repository root) and print what they promise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.real_model]


def _run(name: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args], cwd=ROOT, capture_output=True, text=True, timeout=1500
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_walkthrough_routes_pins_and_runs_the_base_in_one_batch():
    out = _run("walkthrough.py", "How many fruits: an apple, two pears and a banana?")
    assert "[routed per token] adapters used:" in out and "[pinned to counting] adapters used: ['counting']" in out
    assert "[base model] adapters used: ['base']" in out


def test_serve_openai_answers_every_client_call():
    out = _run("serve_openai.py")
    for needle in ("models: ['molora-default'", "json: {", "tool call: get_weather", "finish: tool_calls", "load: 200"):
        assert needle in out, (needle, out)
    assert "prompt logprobs: [('The', None)" in out


def test_train_router_trains_and_routes():
    out = _run("train_router.py")
    assert "'token_accuracy'" in out and "tokens per adapter:" in out
