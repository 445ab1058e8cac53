"""Hot-set adapter memory: bank slots (hot), a CPU tier of read adapters (warm, LRU byte budget), disk (cold).

    slots  (the MoLoRAModel's AdapterBank: S fixed, preallocated slots; loading is a copy)
      ^ promote on a miss / evict the least recently used unpinned adapter into the CPU tier
    CPU tier  (validated `LoRAAdapter`s in host memory, LRU, at most `cpu_bytes` bytes)
      ^ read on a miss that the CPU tier cannot serve / drop the least recently used
    disk  (the PEFT folder each adapter was registered with)

Every adapter the engine knows is *registered* (name -> folder); it may sit in any tier. A request pins
the adapters it may route to for as long as it is in flight (`acquire` / `release`); a pinned adapter is
never evicted and cannot be unloaded. `acquire` is all-or-nothing: it changes nothing when the adapters
cannot all be made resident (every slot pinned by others), and the scheduler retries later.

Owns the tiers, the LRU orders, the pin counts and the counters. Knows adapter names, folders and the
`MoLoRAModel` load/unload calls; knows nothing about requests, KV blocks or routing decisions.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from molora.adapters.io import LoRAAdapter
from molora.errors import AdapterError

log = logging.getLogger("molora.engine")


class HotSet:
    """Adapter tiers of one `MoLoRAModel` (see the module docstring)."""

    def __init__(self, mm: Any, cpu_bytes: int) -> None:
        self.mm = mm
        self.cpu_budget = cpu_bytes
        # registry: every known adapter and its folder (None: given in memory, never dropped from the CPU tier)
        self.paths: dict[str, Path | None] = {n: a.path for n, a in mm.adapters.items()}
        self.cpu: OrderedDict[str, LoRAAdapter] = OrderedDict()   # LRU order: first = least recently used
        self.cpu_used = 0
        self.slot_lru: OrderedDict[str, None] = OrderedDict((n, None) for n in mm.bank.names)
        self.pins: Counter[str] = Counter()
        self.hits = self.misses = self.evictions = self.disk_reads = 0
        self.load_ms_total = 0.0
        self.version = 0  # bumped whenever a slot changes hands (routing lookups depend on it)

    # ------------------------------------------------------------------------------------ queries
    @property
    def names(self) -> list[str]:
        """Registered adapter names, in registration order."""
        return list(self.paths)

    def resident(self, name: str) -> bool:
        return name in self.mm.bank

    def tier(self, name: str) -> str:
        return "slot" if self.resident(name) else "cpu" if name in self.cpu else "disk"

    def check_known(self, names: Iterable[str]) -> None:
        unknown = [n for n in names if n not in self.paths]
        if unknown:
            raise AdapterError(f"unknown adapter(s) {unknown}; registered adapters: {self.names}. "
                               "Load one with Engine.load_adapter(name, path)")

    def stats(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "load_ms_total": round(self.load_ms_total, 3), "disk_reads": self.disk_reads,
                "slots": self.mm.bank.num_slots, "slots_used": len(self.mm.bank.names),
                "cpu_tier_bytes": self.cpu_used, "cpu_tier_budget": self.cpu_budget,
                "pinned": {n: c for n, c in self.pins.items() if c}}

    def describe(self) -> list[dict]:
        bank = self.mm.bank
        return [{"name": n, "path": None if p is None else str(p), "slot": bank.slot_of(n) if n in bank else None,
                 "tier": self.tier(n), "pinned": self.pins[n]} for n, p in self.paths.items()]

    # ------------------------------------------------------------------------------------ pins
    def acquire(self, names: Iterable[str]) -> bool:
        """Make every adapter in `names` resident and pin it. False (nothing changed) if slots are short."""
        want = list(dict.fromkeys(names))
        missing = [n for n in want if not self.resident(n)]
        evictable = [n for n in self.slot_lru if self.pins[n] == 0 and n not in want]
        if len(missing) > len(self.mm.bank.free_slots()) + len(evictable):
            return False
        done: list[str] = []
        try:
            for n in want:
                if n in missing:
                    self.misses += 1
                    self._promote(n)       # may raise (the folder vanished): undo the pins taken so far
                else:
                    self.hits += 1
                    self.slot_lru.move_to_end(n)
                self.pins[n] += 1
                done.append(n)
        except Exception:
            self.release(done)
            raise
        return True

    def release(self, names: Iterable[str]) -> None:
        for n in dict.fromkeys(names):
            assert self.pins[n] > 0, f"adapter {n!r} released more often than acquired"
            self.pins[n] -= 1
            if self.pins[n] == 0:
                del self.pins[n]

    # ------------------------------------------------------------------------------------ run-time changes
    def register(self, name: str, path: str | Path) -> None:
        """Read and validate a PEFT folder, keep it in the CPU tier, and load it into a free slot if any."""
        if name in self.paths:
            raise AdapterError(f"adapter {name!r} is already loaded (from {self.paths[name]}); unload it first")
        adapter = self._read(name, Path(path))
        self.mm.bank.check(adapter)  # fits the bank (targets, rank): refuse now, not at first use
        self.paths[name] = Path(path)
        self._cache(adapter)
        if self.mm.bank.free_slots():
            self._load(adapter)

    def unregister(self, name: str) -> None:
        """Forget an adapter in every tier. Refused while an in-flight request pins it."""
        self.check_known([name])
        if self.pins[name]:
            raise AdapterError(f"adapter {name!r} is in use by {self.pins[name]} in-flight request(s); "
                               "abort them or wait for them to finish before unloading it")
        if self.resident(name):
            self.mm.unload_adapter(name)
            del self.slot_lru[name]
            self.version += 1
        if name in self.cpu:
            self.cpu_used -= self.cpu.pop(name).nbytes()
        del self.paths[name]

    # ------------------------------------------------------------------------------------ internals
    def _promote(self, name: str) -> None:
        adapter = self.cpu.get(name)
        if adapter is not None:
            self.cpu.move_to_end(name)
        else:
            path = self.paths[name]
            assert path is not None, f"in-memory adapter {name!r} left the CPU tier"
            adapter = self._read(name, path)
            self._cache(adapter)
        if not self.mm.bank.free_slots():
            victim = next(n for n in self.slot_lru if self.pins[n] == 0)  # acquire checked one exists
            self._evict(victim)
        self._load(adapter)

    def _load(self, adapter: LoRAAdapter) -> None:
        t0 = time.perf_counter()
        self.mm.load_adapter(adapter.name, adapter)   # a copy into the slot tensors
        self.load_ms_total += (time.perf_counter() - t0) * 1e3
        self.slot_lru[adapter.name] = None
        self.version += 1

    def _evict(self, name: str) -> None:
        adapter = self.mm.adapters[name]
        self.mm.unload_adapter(name)
        del self.slot_lru[name]
        self.evictions += 1
        self.version += 1
        self._cache(adapter)
        log.debug("evicted adapter %r from its slot", name)

    def _read(self, name: str, path: Path) -> LoRAAdapter:
        self.disk_reads += 1
        return self.mm.read(name, path)

    def _cache(self, adapter: LoRAAdapter) -> None:
        """Put `adapter` at the recent end of the CPU tier and drop old entries beyond the byte budget."""
        if adapter.name in self.cpu:
            self.cpu.move_to_end(adapter.name)
            return
        size = adapter.nbytes()
        if size > self.cpu_budget and self.paths.get(adapter.name) is not None:
            return  # too big to keep warm; the disk serves it
        self.cpu[adapter.name] = adapter
        self.cpu_used += size
        for old in list(self.cpu):
            if self.cpu_used <= self.cpu_budget:
                break
            if old == adapter.name or self.paths.get(old) is None:
                continue  # keep the newcomer and adapters that exist only in memory
            self.cpu_used -= self.cpu.pop(old).nbytes()
