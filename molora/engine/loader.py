"""The hot set's loader thread: one worker that reads adapter folders off the engine thread.

Its scheduling priority is a knob, `MOLORA_LOADER_NICE` (0-19, default 0: the engine's priority). Lowering it
(Linux applies nice per thread, and threads the loader starts inherit it) was measured under 1,000-adapter traffic
on 2 cores (docs/hotset_loader_nice_ab.json, `molora bench hotset --traffic --loader-nice-ab`): at nice +10 the
p99 inter-token gap of warm requests on load steps rose more, not less, than at 0, in every repetition. The
likely cause is the GIL: the loader's Python work holds it, and a loader descheduled at low priority keeps the
engine thread waiting for it. So the default stays 0.

Owns the pool's construction and the folder size a read reserves; knows nothing of tiers or requests.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from molora.adapters.io import WEIGHTS_FILE

log = logging.getLogger("molora.engine")

THREAD_NAME = "molora-adapter-io"


def loader_nice() -> int:
    """How much the loader thread lowers its priority: `MOLORA_LOADER_NICE` (0-19), default 0."""
    raw = os.environ.get("MOLORA_LOADER_NICE", "0")
    if not raw.strip().isdigit() or int(raw) > 19:
        raise ValueError(f"MOLORA_LOADER_NICE={raw!r}: give an integer from 0 (same priority) to 19 (lowest)")
    return int(raw)


def lower_priority(by: int) -> int | None:
    """Raise the calling thread's nice value by `by` (capped at 19); its new nice value, or None where the
    platform has no per-thread priority (then nothing changes)."""
    if by == 0 or not hasattr(os, "setpriority"):
        return None
    tid = threading.get_native_id()  # Linux: a thread's id is a valid PRIO_PROCESS target and affects that thread
    try:
        nice = min(19, os.getpriority(os.PRIO_PROCESS, tid) + by)
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as e:  # raising one's own nice value is always allowed; log and go on if a sandbox refuses
        log.warning("adapter loader: could not lower its priority (%s); reads run at the engine's priority", e)
        return None
    return nice


def loader_pool() -> ThreadPoolExecutor:
    """The one-worker pool a hot set reads adapters on, its thread at `loader_nice()` lower priority."""
    by = loader_nice()  # read now, on the caller's thread, so a bad value fails where it can be reported
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME, initializer=lower_priority, initargs=(by,))


def folder_bytes(path: Path) -> int:
    """The size of a PEFT folder's weights file: a read reserves it (the tensors it holds take no more)."""
    try:
        return (path / WEIGHTS_FILE).stat().st_size
    except OSError:
        return 0  # missing or unreadable: the read fails and says why
