"""The hot set's loader thread's priority knob (molora.engine.loader): MOLORA_LOADER_NICE, default 0."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from molora.engine.loader import loader_nice, loader_pool

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")


def _own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@linux
@pytest.mark.parametrize("setting, rise", [(None, 0), ("0", 0), ("10", 10)])
def test_loader_thread_is_niced_and_the_caller_is_not(monkeypatch, setting, rise):
    if setting is None:
        monkeypatch.delenv("MOLORA_LOADER_NICE", raising=False)
    else:
        monkeypatch.setenv("MOLORA_LOADER_NICE", setting)
    mine = _own_nice()
    pool = loader_pool()
    try:
        theirs = pool.submit(_own_nice).result(timeout=30)
        name = pool.submit(lambda: threading.current_thread().name).result(timeout=30)
    finally:
        pool.shutdown()
    assert theirs == min(19, mine + rise)
    assert _own_nice() == mine  # only the loader's thread changed
    assert name.startswith("molora-adapter-io")


@pytest.mark.parametrize("bad", ["-1", "20", "ten", "", "1.5"])
def test_bad_loader_nice_is_refused_with_the_range(monkeypatch, bad):
    monkeypatch.setenv("MOLORA_LOADER_NICE", bad)
    with pytest.raises(ValueError, match="0 .* to 19"):
        loader_nice()
    with pytest.raises(ValueError, match="MOLORA_LOADER_NICE"):
        loader_pool()
