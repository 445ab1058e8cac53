"""Hot-set adapter memory: bank slots (hot), a CPU tier of read adapters (warm, LRU byte budget), disk (cold).

    slots  (the MoLoRAModel's AdapterBank: S fixed, preallocated slots; loading is a copy)
      ^ promote on a miss / evict the least recently used unpinned adapter into the CPU tier
    CPU tier  (validated `LoRAAdapter`s in host memory, LRU, at most `cpu_bytes` bytes)
      ^ a finished background read joins it / drop the least recently used
    loader thread  (molora.engine.loader: one worker, at a lower priority, reads and validates folders)
      ^ started by a miss that neither a slot nor the CPU tier can serve
    disk  (the PEFT folder each adapter was registered with, confined to its roots if it was given any)

Every adapter the engine knows is *registered* (name -> folder, roots); it may sit in any tier. A request
pins the adapters it may route to for as long as it is in flight (`acquire` / `release`); a pinned adapter
is never evicted. `acquire` is all-or-nothing and never touches the disk: an adapter in no tier gets a
background read (started once) and `acquire` returns False, changing nothing; once the read is done, the
next `acquire` puts it in the CPU tier and copies it into a slot (the only adapter work an engine step
does). `acquire` also returns False when the adapters cannot all be made resident (every slot pinned by
others); `fetch` tells the two apart for the scheduler. A failed read raises an `AdapterError` from the
next `acquire` / `fetch` that needs the adapter and is then forgotten, so a fixed folder reads again.

Prefetch and memory bounds: `prefetch` starts the reads of the adapters queued requests will need when they
are queued (the scheduler calls it from `add` and, for the whole queue in order, after every admission), so
that a cold adapter is usually warm by the time its request reaches the front. Every read *reserves* its
folder's size in the CPU tier's budget when it starts and keeps it until its adapter is taken into a slot,
joins the tier, or is dropped (a finished read nobody queued wants any more). A prefetch only starts when the
reservation fits the budget after dropping least recently used entries that no queued request wants; it never
touches slots, so it cannot evict an adapter a running request pins. A read on demand (`fetch` / `acquire`)
may also displace wanted entries, and when nothing is reserved it may overdraw the budget by that one read
(else a budget smaller than one adapter could never serve a cold one). So at every moment

    cpu_tier_bytes + reserved_bytes <= cpu_budget + bytes of in-memory-only adapters + the one overdraft read

(`check`), and host memory for adapters is that plus the adapters resident in slots (their host copies).
Slot eviction counts sets: a victim is the least recently used unpinned adapter outside the acquiring
request's set, preferring one no queued request wants.

Unloading: `unregister` forgets an adapter in every tier (refused while pinned). An adapter being unloaded
while requests still use it is *draining* (`drain`): it stays registered and resident for them, new
requests do not route to it (the engine leaves it out of their allowed set), and the scheduler unregisters
it when its last user leaves. Registering a draining name is refused.

Owns the tiers, the LRU orders, the pin counts, the loader thread and the counters. Knows adapter names, folders,
the `MoLoRAModel` read/load/unload calls and its linears' shapes; knows nothing about requests, KV blocks or routing
decisions. All methods run on the engine thread except `read` (any thread) and the loader's reads.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING

from molora.adapters.io import LoRAAdapter, resolve_roots
from molora.engine.loader import folder_bytes, loader_pool
from molora.errors import AdapterDraining, AdapterError, AdapterNotFound
from molora.model.lora_linear import linear_shapes

if TYPE_CHECKING:
    from molora.model.attach import MoLoRAModel

log = logging.getLogger("molora.engine")

Roots = tuple[Path, ...] | None

READ_AHEAD = 4  # most reads (in flight or finished and not yet taken) that `prefetch` keeps outstanding


class HotSet:
    """Adapter tiers of one `MoLoRAModel` (see the module docstring)."""

    def __init__(self, mm: MoLoRAModel, cpu_bytes: int) -> None:
        self.mm = mm
        self.cpu_budget = cpu_bytes
        # registry: every known adapter, its folder (None: given in memory, never dropped from the CPU tier)
        # and the roots its files must resolve into on every read (None: unconfined)
        self.paths: dict[str, Path | None] = {n: a.path for n, a in mm.adapters.items()}
        self.roots: dict[str, Roots] = {n: a.roots for n, a in mm.adapters.items()}
        self.draining: set[str] = set()
        self.cpu: OrderedDict[str, LoRAAdapter] = OrderedDict()  # LRU order: first = least recently used
        self.cpu_used = 0
        self.slot_lru: OrderedDict[str, None] = OrderedDict((n, None) for n in mm.bank.names)
        self.pins: Counter[str] = Counter()
        self.reads: dict[str, Future[LoRAAdapter]] = {}  # background reads, in flight or done and not yet taken
        self.reserved: dict[str, int] = {}  # bytes each read in `reads` holds against the CPU tier's budget
        self.overdraft: str | None = None  # the read (on demand, nothing else reserved) let past the budget
        self.wanted: set[str] = set()  # adapters the queued requests need (`prefetch`)
        self._pool: ThreadPoolExecutor | None = None  # the loader thread, started by the first read
        self.shapes = linear_shapes(mm.model)  # the model's linears, walked once, not at every read (1 of 8 ms)
        self.hits = self.misses = self.evictions = self.disk_reads = self.read_failures = 0
        self.prefetches = self.prefetch_deferred = 0  # reads started by `prefetch` / prefetches the budget refused
        self.load_ms_total = 0.0
        # per adapter: slot loads, evictions and load time (ms) since it was first seen (the server's /metrics)
        self.loads_by: Counter[str] = Counter()
        self.evictions_by: Counter[str] = Counter()
        self.load_ms_by: dict[str, float] = {}
        self.version = 0  # bumped whenever a slot changes hands (routing lookups depend on it)
        # content versions (`content_version`): name -> (the resident LoRAAdapter object, weakly, its version)
        self._versions: dict[str, tuple[weakref.ref, int]] = {}
        self._version_ids = itertools.count(1)

    # ------------------------------------------------------------------------------------ queries
    @property
    def names(self) -> list[str]:
        """Registered adapter names, in registration order."""
        return list(self.paths)

    def resident(self, name: str) -> bool:
        return name in self.mm.bank

    def content_version(self, name: str) -> int | None:
        """An id of the weights in `name`'s slot (None: not resident): it stays the same while the same
        validated `LoRAAdapter` object is what was copied in (an eviction and a reload from the CPU tier copy
        the same bytes), and is new for every other load: a fresh read of the folder, a re-registration after
        an unload, a repair (`forget_version`). The prefix cache keys KV by it (molora.engine.prefix)."""
        adapter = self.mm.adapters.get(name)
        if adapter is None or not self.resident(name):
            return None
        known = self._versions.get(name)
        if known is None or known[0]() is not adapter:
            known = (weakref.ref(adapter), next(self._version_ids))
            self._versions[name] = known
        return known[1]

    def forget_version(self, name: str) -> None:
        """`name`'s slot was rewritten in place: its next `content_version` is a new one."""
        self._versions.pop(name, None)

    def tier(self, name: str) -> str:
        return "slot" if self.resident(name) else "cpu" if name in self.cpu else "disk"

    def state(self, name: str) -> str:
        """ "draining" (being unloaded), "loading" (a background read is in flight) or "ready"."""
        if name in self.draining:
            return "draining"
        read = self.reads.get(name)
        return "loading" if read is not None and not read.done() else "ready"

    def check_known(self, names: Iterable[str]) -> None:
        unknown = [n for n in names if n not in self.paths]
        if unknown:
            raise AdapterNotFound(
                f"unknown adapter(s) {unknown}; registered adapters: {self.names}. "
                "Load one with Engine.load_adapter(name, path)"
            )

    def reads_in_flight(self) -> int:
        return sum(not f.done() for f in self.reads.values())

    def stats(self) -> dict:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "load_ms_total": round(self.load_ms_total, 3),
            "disk_reads": self.disk_reads,
            "reads_in_flight": self.reads_in_flight(),
            "read_failures": self.read_failures,
            "slots": self.mm.bank.num_slots,
            "slots_used": len(self.mm.bank.names),
            "cpu_tier_bytes": self.cpu_used,
            "cpu_tier_budget": self.cpu_budget,
            "reserved_bytes": sum(self.reserved.values()),
            "host_bytes": self.host_bytes(),
            "memory_only_bytes": self._memory_only_bytes(),
            "prefetches": self.prefetches,
            "prefetch_deferred": self.prefetch_deferred,
            "pinned": {n: c for n, c in self.pins.items() if c},
            "adapters": {  # every registered adapter: its tier now, and its slot loads, evictions and load time
                n: {
                    "tier": self.tier(n),
                    "loads": self.loads_by[n],
                    "evictions": self.evictions_by[n],
                    "load_ms": round(self.load_ms_by.get(n, 0.0), 3),
                }
                for n in self.paths
            },
        }

    def host_bytes(self) -> int:
        """Host bytes of every adapter the hot set holds: the CPU tier, resident adapters' own copies and
        finished reads not yet taken (each adapter counted once)."""
        held: dict[str, LoRAAdapter] = dict(self.cpu)
        held.update((n, a) for n, a in self.mm.adapters.items() if n not in held)
        for n, f in self.reads.items():
            if n not in held and f.done() and not f.cancelled() and f.exception() is None:
                held[n] = f.result()
        return sum(a.nbytes() for a in held.values())

    def _memory_only_bytes(self) -> int:
        return sum(a.nbytes() for n, a in self.cpu.items() if self.paths.get(n, 0) is None)

    def check(self) -> None:
        """Assert the tier bounds and bookkeeping (module docstring): the CPU tier's byte count, reservations
        only for reads, the byte bound, pins only on resident adapters, the LRU order over exactly the slots."""
        assert self.cpu_used == sum(a.nbytes() for a in self.cpu.values()), "CPU tier byte count drifted"
        assert set(self.reserved) <= set(self.reads), "a reservation without its read"
        assert self.overdraft is None or self.overdraft in self.reserved
        over = self.reserved.get(self.overdraft, 0) if self.overdraft is not None else 0
        used = self.cpu_used + sum(self.reserved.values())
        assert used <= self.cpu_budget + self._memory_only_bytes() + over, (
            f"CPU tier {self.cpu_used} + reserved {sum(self.reserved.values())} B over its budget {self.cpu_budget} B"
        )
        assert list(self.slot_lru) == [n for n in self.slot_lru if n in self.mm.bank]
        assert set(self.slot_lru) == set(self.mm.bank.names), "LRU order and bank disagree"
        assert all(self.resident(n) for n, c in self.pins.items() if c), "a pinned adapter is not resident"

    def describe(self) -> list[dict]:
        bank = self.mm.bank
        return [
            {
                "name": n,
                "path": None if p is None else str(p),
                "slot": bank.slot_of(n) if n in bank else None,
                "tier": self.tier(n),
                "pinned": self.pins[n],
                "state": self.state(n),
            }
            for n, p in self.paths.items()
        ]

    # ------------------------------------------------------------------------------------ pins
    def fetch(self, names: Iterable[str]) -> bool:
        """True if every adapter in `names` is resident, in the CPU tier or read; otherwise start the missing
        reads (once) and return False. Raises AdapterError for a failed read (and forgets it)."""
        ready = True
        for n in dict.fromkeys(names):
            if not self.resident(n) and self._warm(n) is None:
                ready = False
        return ready

    def prefetch(self, names: Iterable[str], *, queue: bool = False) -> int:
        """Start background reads of adapters queued requests need, in the order given, while the CPU tier's
        budget has room for them after dropping entries no queued request wants (module docstring); returns
        how many started. queue=True: `names` is the whole queue's demand in queue order (the wanted set is
        replaced; finished reads nobody wants any more join the tier if they fit, else are dropped); else it is
        added to (a request just queued). Never touches slots or pins; unknown names are ignored."""
        want = [n for n in dict.fromkeys(names) if n in self.paths]
        if queue:
            self.wanted = set(want)
            for n in [n for n, f in self.reads.items() if f.done() and n not in self.wanted]:
                self._take_read(n)
        else:
            self.wanted.update(want)
        started = 0
        for n in want:
            if self.resident(n) or n in self.cpu or n in self.reads:
                continue
            if len(self.reads) >= READ_AHEAD or not self._start_read(n, demand=False):
                self.prefetch_deferred += 1
                break  # queue order: a later request's read must not take the room of an earlier one's
            self.prefetches += 1
            started += 1
        return started

    def acquire(self, names: Iterable[str]) -> bool:
        """Make every adapter in `names` resident and pin it. False (nothing changed) while a read is in flight
        (`fetch`) or if slots are short. Raises AdapterError (nothing pinned) for a failed read."""
        want = list(dict.fromkeys(names))
        missing = [n for n in want if not self.resident(n)]
        found = {n: self._warm(n) for n in missing}
        warm = {n: a for n, a in found.items() if a is not None}
        if len(warm) < len(found):
            return False
        evictable = [n for n in self.slot_lru if self.pins[n] == 0 and n not in want]
        if len(missing) > len(self.mm.bank.free_slots()) + len(evictable):
            return False
        done: list[str] = []
        try:
            for n in want:
                if n in warm:
                    self.misses += 1
                    self._promote(warm[n], want)
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

    def wait_reads(self, timeout: float | None = None) -> bool:
        """Block until a background read finishes (or `timeout` seconds); False if no read was in flight or
        waiting to be taken (a read that finished just before this call counts: acquire takes it next)."""
        pending = [f for f in self.reads.values() if not f.done()]
        if pending:
            wait(pending, timeout, return_when=FIRST_COMPLETED)
        return bool(self.reads)

    # ------------------------------------------------------------------------------------ run-time changes
    def read(self, name: str, path: str | Path, roots: Sequence[str | Path] | None = None) -> LoRAAdapter:
        """Read and validate a PEFT folder and check that it fits the bank. Changes nothing: safe on any
        thread (a server reads on a worker, then `register`s the adapter on the engine thread)."""
        self._check_free(name)
        return self._read(name, Path(path), resolve_roots(roots))

    def register(self, name: str, source: str | Path | LoRAAdapter, roots: Sequence[str | Path] | None = None) -> None:
        """Register a PEFT folder (read and validated now, on this thread) or an adapter already read
        (`read`); keep it in the CPU tier and load it into a free slot if any. `roots` confine every later
        re-read of its folder (default for an adapter object: the roots it was read with)."""
        self._check_free(name)
        if isinstance(source, LoRAAdapter):
            adapter = source if source.name == name else dataclasses.replace(source, name=name)
            self.mm.bank.check(adapter)
            confined = resolve_roots(roots) if roots is not None else adapter.roots
        else:
            confined = resolve_roots(roots)
            adapter = self.read(name, source, confined)
            self.disk_reads += 1  # counted once it succeeded: a refused load changes nothing, counters included
        self.paths[name] = adapter.path
        self.roots[name] = confined
        self._cache(adapter)
        if self.mm.bank.free_slots():
            self._load(adapter)

    def register_cold(self, name: str, path: Path, roots: Roots) -> None:
        """Register a folder whose config the caller checked (`MoLoRAModel.read_ranks`) without reading its weights:
        it sits in no tier until a request needs it, then a miss reads it on the loader thread like any cold one."""
        self._check_free(name)
        self.paths[name], self.roots[name] = path, roots

    def drain(self, name: str) -> None:
        """Mark a registered adapter as being unloaded: the scheduler unregisters it after its last user."""
        self.check_known([name])
        self.draining.add(name)

    def unregister(self, name: str) -> None:
        """Forget an adapter in every tier (a read in flight is dropped). Refused while a request pins it."""
        self.check_known([name])
        if self.pins[name]:
            raise AdapterError(
                f"adapter {name!r} is in use by {self.pins[name]} in-flight request(s); "
                "abort them or wait for them to finish before unloading it"
            )
        if self.resident(name):
            self.mm.unload_adapter(name)
            del self.slot_lru[name]
            self.version += 1
        self.forget_warm(name)
        read = self.reads.get(name)
        if read is not None:
            self._forget_read(name)
            read.cancel()  # a running read finishes on the loader thread; its result is never looked at
        self.draining.discard(name)
        self.wanted.discard(name)
        self.forget_version(name)
        del self.paths[name], self.roots[name]

    def forget_warm(self, name: str) -> None:
        """Drop `name`'s copy from the CPU tier, if it has one (the next miss reads its folder again)."""
        if name in self.cpu:
            self.cpu_used -= self.cpu.pop(name).nbytes()

    def close(self) -> None:
        """Stop the loader thread (reads in flight are dropped). A later miss starts a new one."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self.reads.clear()
        self.reserved.clear()
        self.overdraft = None

    # ------------------------------------------------------------------------------------ internals
    def _check_free(self, name: str) -> None:
        if name in self.draining:
            raise AdapterDraining(
                f"adapter {name!r} is still draining (being unloaded; in-flight requests use it); "
                "wait for them to finish, or unload it with force=True, before loading it again"
            )
        if name in self.paths:
            raise AdapterError(f"adapter {name!r} is already loaded (from {self.paths[name]}); unload it first")

    def _warm(self, name: str) -> LoRAAdapter | None:
        """The adapter from the CPU tier or its finished read; None while it is being read (a read is started
        if none is). Raises AdapterError if the read failed, forgetting the failure."""
        adapter = self.cpu.get(name)
        if adapter is not None:
            return adapter
        read = self.reads.get(name)
        if read is None:
            self._start_read(name, demand=True)  # or deferred until a reservation is given back
            return None
        if not read.done():
            return None
        try:
            return read.result()
        except Exception as e:
            self._forget_read(name)
            self.read_failures += 1
            if isinstance(e, AdapterError):
                raise AdapterError(str(e)) from e
            raise AdapterError(f"adapter {name!r}: reading {self.paths[name]} failed ({type(e).__name__}: {e})") from e

    def _start_read(self, name: str, *, demand: bool) -> bool:
        """Start a background read of `name`'s folder if its size fits the CPU tier's budget beside what is
        held and reserved (dropping least recently used entries; wanted ones only on `demand`). On demand with
        nothing reserved it starts anyway (the overdraft). False: not started, nothing changed."""
        path = self.paths[name]
        assert path is not None, f"in-memory adapter {name!r} left the CPU tier"
        size = folder_bytes(path)
        if not self._room(size, displace_wanted=demand):
            if not demand or self.reserved:
                return False
            self.overdraft = name
        if self._pool is None:
            self._pool = loader_pool()
        self.disk_reads += 1
        self.reserved[name] = size
        self.reads[name] = self._pool.submit(self._read, name, path, self.roots[name])
        return True

    def _forget_read(self, name: str) -> None:
        """Drop `name`'s read and give back its reservation."""
        self.reads.pop(name, None)
        self.reserved.pop(name, None)
        if self.overdraft == name:
            self.overdraft = None

    def _take_read(self, name: str) -> None:
        """A finished read no queued request wants: its adapter joins the CPU tier if it fits (else dropped);
        a failed one is forgotten (nobody is left to tell)."""
        read = self.reads[name]
        self._forget_read(name)
        if not read.cancelled() and read.exception() is None:
            self._cache(read.result())

    def _room(self, nbytes: int, *, displace_wanted: bool) -> bool:
        """Make `nbytes` fit the CPU tier's budget beside what it holds and what reads reserve, by dropping
        least recently used entries (unwanted first; wanted ones too if `displace_wanted`; never in-memory
        ones). False, with nothing dropped, if that cannot be done."""
        need = self.cpu_used + sum(self.reserved.values()) + nbytes - self.cpu_budget
        if need <= 0:
            return True
        droppable = [n for n in self.cpu if self.paths.get(n) is not None and n not in self.wanted]
        if displace_wanted:
            droppable += [n for n in self.cpu if self.paths.get(n) is not None and n in self.wanted]
        victims = []
        for n in droppable:
            if need <= 0:
                break
            victims.append(n)
            need -= self.cpu[n].nbytes()
        if need > 0:
            return False
        for n in victims:
            self.cpu_used -= self.cpu.pop(n).nbytes()
        return True

    def _read(self, name: str, path: Path, roots: Roots) -> LoRAAdapter:
        """Disk and validation only, no HotSet or model state (runs on the loader thread, or on any thread
        for `read`)."""
        adapter = self.mm.read(name, path, roots=roots, shapes=self.shapes)
        self.mm.bank.check(adapter)  # fits the bank (targets, rank): refuse now, not at first use
        return adapter

    def _promote(self, adapter: LoRAAdapter, keep: list[str]) -> None:
        """Copy a warm adapter into a slot, evicting the least recently used unpinned one not in `keep`,
        preferring one that no queued request wants."""
        self._forget_read(adapter.name)  # a finished read is taken now
        self._cache(adapter)
        if not self.mm.bank.free_slots():
            free = [n for n in self.slot_lru if self.pins[n] == 0 and n not in keep]  # acquire checked: not empty
            victim = next((n for n in free if n not in self.wanted), free[0])
            self._evict(victim)
        self._load(adapter)

    def _load(self, adapter: LoRAAdapter) -> None:
        t0 = time.perf_counter()
        self.mm.load_adapter(adapter.name, adapter)  # a copy into the slot tensors
        ms = (time.perf_counter() - t0) * 1e3
        self.load_ms_total += ms
        self.loads_by[adapter.name] += 1
        self.load_ms_by[adapter.name] = self.load_ms_by.get(adapter.name, 0.0) + ms
        self.slot_lru[adapter.name] = None
        self.version += 1

    def _evict(self, name: str) -> None:
        adapter = self.mm.adapters[name]
        self.mm.unload_adapter(name)
        del self.slot_lru[name]
        self.evictions += 1
        self.evictions_by[name] += 1
        self.version += 1
        self._cache(adapter)
        log.debug("evicted adapter %r from its slot", name)

    def _cache(self, adapter: LoRAAdapter) -> None:
        """Put `adapter` at the recent end of the CPU tier, dropping least recently used entries to stay in the
        byte budget (a wanted newcomer may drop wanted entries, others only unwanted ones). If it cannot fit, the
        disk serves it next time; an adapter that exists only in memory is always kept."""
        if adapter.name in self.cpu:
            self.cpu.move_to_end(adapter.name)
            return
        if self.paths.get(adapter.name) is not None and not self._room(
            adapter.nbytes(), displace_wanted=adapter.name in self.wanted
        ):
            return
        self.cpu[adapter.name] = adapter
        self.cpu_used += adapter.nbytes()
