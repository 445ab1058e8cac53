"""Python's garbage collector and a long-lived engine: freeze the heap once the engine is built.

CPython's full (generation-2) collection walks every tracked container object of the process: the model's modules
and parameters, the tokenizer, the adapter registry. Under 1,000-adapter traffic on 2 cores such a collection took
210-230 ms and fell inside an engine step in 4 of 6 runs (about ten steps' time; `molora bench hotset --traffic`,
docs/hotset_traffic_stalls.json, its `gc` block). None of those objects is garbage: they live as long as the
process. `freeze_heap()` collects once and moves everything alive into the collector's permanent generation
(`gc.freeze()`), so later collections walk only what was made after it; objects that die later are still freed (by
reference counting, or by a collection if they were made after the freeze). In a process holding that engine
(478,000 tracked objects), one full collection took 188 ms unfrozen and 0.003 ms frozen (medians of 7, alternating:
experiments/gc_pause.py, docs/gc_pause.json). How often one falls in a step depends on how long the process has run:
the bench's A/B (`--gc-freeze-ab`, docs/hotset_gc_freeze_ab.json) starts every run after a full collection, and
no arm, frozen or not, had one in 200 requests; a server runs for hours.

`molora serve` calls it once the engine and its adapters are built (molora.server.launch); not under Ray, whose
replicas build and drop bundles' engines (an engine frozen and then dropped would never be collected).
`MOLORA_GC_FREEZE=0` turns it off. Owns nothing else.
"""

from __future__ import annotations

import gc
import logging
import os

log = logging.getLogger("molora.engine")


def freeze_enabled() -> bool:
    """`MOLORA_GC_FREEZE`: 1 (default) or 0; anything else is refused with the values it takes."""
    raw = os.environ.get("MOLORA_GC_FREEZE", "1").strip()
    if raw not in ("0", "1"):
        raise ValueError(f"MOLORA_GC_FREEZE={raw!r}: set 1 (freeze the heap after start-up, the default) or 0")
    return raw == "1"


def freeze_heap() -> int:
    """Collect, then freeze every object alive now (module docstring); the number of objects frozen (0: turned off
    by MOLORA_GC_FREEZE=0)."""
    if not freeze_enabled():
        return 0
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    log.info("froze %d objects built at start-up out of Python's garbage collections (MOLORA_GC_FREEZE=0: off)", n)
    return n


def unfreeze_heap() -> None:
    """Undo `freeze_heap` (a bench that builds one engine after another), and collect what the last one left."""
    gc.unfreeze()
    gc.collect()
