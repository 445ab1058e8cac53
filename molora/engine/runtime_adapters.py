"""Adapters at run time: the part of `Engine` (molora.engine.engine) that reads, registers, lists and unloads them.

A cold adapter is read and validated on the hot set's loader thread while the steps go on (the step only copies
a read adapter into a slot); `read_adapter` reads on any thread and `load_adapter(name, adapter)` registers the
result; `unload_adapter` drains an adapter that requests in flight still use (new requests leave it out) or, with
force=True, aborts them. The slots, tiers and pins themselves belong to molora.engine.hotset.

Knows adapter names, folders and the requests that use them; nothing about KV, sampling or HTTP.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from molora.adapters.io import LoRAAdapter, resolve_roots
from molora.engine.hotset import HotSet
from molora.engine.scheduler import Scheduler
from molora.errors import AdapterError
from molora.model.lora_linear import linear_shapes

log = logging.getLogger("molora.engine")


class _EngineParts(Protocol):
    """What RuntimeAdapters uses of the engine it is part of."""

    hotset: HotSet
    scheduler: Scheduler

    def abort(self, request_id: str, error: str | None = None) -> None: ...


class RuntimeAdapters:
    """Engine's adapter management (module docstring)."""

    hotset: HotSet

    def read_adapter(self, name: str, path: str | Path, *, roots: Sequence[str | Path] | None = None) -> LoRAAdapter:
        """Read and validate a PEFT folder for `load_adapter` (fits the bank; with `roots`, every file must
        resolve inside one of them). Touches no engine state: call it on any thread, e.g. a server's
        `asyncio.to_thread`, then `load_adapter(name, adapter)` on the engine thread."""
        return self.hotset.read(name, path, roots)

    def load_adapter(
        self, name: str, source: str | Path | LoRAAdapter, *, roots: Sequence[str | Path] | None = None
    ) -> None:
        """Register an adapter at run time: a PEFT folder (read and validated here, on this thread) or an
        adapter from `read_adapter`. Loaded into a free slot if there is one. `roots` confine every later
        re-read of the folder (an adapter from read_adapter keeps the roots it was read with). Refused, with
        nothing changed, for a bad folder, a name in use, or a name still draining."""
        self.hotset.register(name, source, roots)

    def register_adapters(
        self, folders: Mapping[str, str | Path], *, roots: Sequence[str | Path] | None = None
    ) -> None:
        """Make PEFT folders known by name without reading their weights (thousands at start: a directory of
        adapters, `molora.adapters.io.scan_adapter_dir`). Each `adapter_config.json` is read and checked against
        the model and the bank now, all before any is registered: one bad folder or a name in use refuses them
        all, nothing changed. A weights file is read when a request first needs it (on the loader thread, as for
        any adapter in no tier); one that turns out bad fails that request and is read again next time. `roots`
        confine every read of the folders."""
        hs = self.hotset
        confined = resolve_roots(roots)
        taken = sorted(n for n in folders if n in hs.paths or n in hs.draining)
        if taken:
            raise AdapterError(f"adapter names already registered {taken[:8]}; unload them or rename the folders")
        shapes = linear_shapes(hs.mm.model)
        for name, path in folders.items():
            ranks = hs.mm.read_ranks(name, path, roots=confined, shapes=shapes)
            hs.mm.bank.check_ranks(f"adapter {name!r} ({path})", ranks)
        for name, path in folders.items():
            hs.register_cold(name, Path(path), confined)
        log.info("%d adapters registered (configs read; weights on first use)", len(folders))

    def unload_adapter(self: _EngineParts, name: str, force: bool = False) -> str:
        """Unload an adapter: "unloaded" when it is gone now, "draining" when requests in flight (running or
        queued) may still route to it: new requests no longer do, and it is unloaded when the last of those
        finishes (Scheduler.finish). force=True aborts those requests (finish_reason "abort", with an error
        naming the adapter) and unloads it now. Unknown names raise AdapterError."""
        hs = self.hotset
        hs.check_known([name])
        users = self.scheduler.users(name)
        if force:
            why = f"adapter {name!r} was unloaded (force) while this request used it"
            for req in users:
                self.abort(req.request_id, error=why)
            if name in hs.paths:  # the last abort already unregistered it if it was draining
                hs.unregister(name)
            log.info("adapter %r unloaded (force), %d request(s) aborted", name, len(users))
            return "unloaded"
        if not users:
            hs.unregister(name)
            return "unloaded"
        if name not in hs.draining:
            hs.drain(name)
            log.info("adapter %r draining: %d request(s) in flight use it", name, len(users))
        return "draining"

    def list_adapters(self) -> list[dict]:
        """name, path, slot (or None), tier ("slot" | "cpu" | "disk"), pin count and state ("ready" |
        "loading": a background read is in flight | "draining": being unloaded) of every adapter."""
        return self.hotset.describe()

    def close(self) -> None:
        """Stop the adapter loader thread (HotSet.close); the engine still works, a later miss restarts it."""
        self.hotset.close()
