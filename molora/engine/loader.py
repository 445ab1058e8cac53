"""The hot set's loader thread: one worker that reads adapter folders off the engine thread, at a lower priority.

On a machine whose cores all run the engine's steps (torch's intra-op threads), a read competing with them at
the same priority stretches the step it overlaps: the engine waits for its slowest thread. The loader therefore
lowers its own scheduling priority by `LOADER_NICE` (Linux applies nice per thread, and threads the loader starts,
such as an OpenMP team for a dtype conversion, inherit it), so the kernel gives the engine's threads the cores
first and the read fills the gaps. A read then takes longer on a busy machine, which only its own request waits
for (a cold request's time to first token); warm requests keep their pace. `MOLORA_LOADER_NICE=0` keeps the
loader at the engine's priority (the A/B in `molora bench hotset --traffic --loader-nice`).

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
    """How much the loader thread lowers its priority: `MOLORA_LOADER_NICE` (0-19), default 10."""
    raw = os.environ.get("MOLORA_LOADER_NICE", "10")
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
