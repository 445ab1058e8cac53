"""Adapters at run time: `AdapterManager`, the part an `Engine` (molora.engine.engine) owns that reads, registers,
lists and unloads them (`Engine.load_adapter` & co. are its front door).

A cold adapter is read and validated on the hot set's loader thread while the steps go on (the step only copies
a read adapter into a slot); `read` reads on any thread and `load(name, adapter)` registers the result; `unload`
drains an adapter that requests in flight still use (new requests leave it out) or, with
force=True, aborts them. The slots, tiers and pins themselves belong to molora.engine.hotset.

On a model with a per-request chooser (`--router hybrid`: `mm.chooser`, rebuilt by `mm.calibration`), the chooser
follows the adapters: a load recalibrates it for the new set (`load_stages`: only the new adapter's
statistics are computed, one forward pass per stage, with the adapter pinned), built aside and swapped in by the
last stage, between engine steps, so no step or choice ever sees a half-built one; a calibration that fails
unregisters the adapter again (registry and chooser as they were) and raises. An unload drops the adapter from the
chooser at once (no forward pass: the others keep their statistics).

Knows adapter names, folders and the requests that use them; nothing about KV, sampling or HTTP.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Mapping, Sequence
from pathlib import Path
from typing import Any

from molora.adapters.io import LoRAAdapter, resolve_roots
from molora.engine.hotset import HotSet
from molora.engine.scheduler import Scheduler
from molora.errors import AdapterError, BankFullError, CalibrationError, MoLoRAError
from molora.model.lora_linear import linear_shapes

log = logging.getLogger("molora.engine")


class AdapterManager:
    """The engine's adapter management (module docstring). `abort(request_id, error)` ends a request in flight
    (the engine's), for a forced unload."""

    def __init__(self, hotset: HotSet, scheduler: Scheduler, abort: Callable[[str, str | None], None]) -> None:
        self.hotset, self.scheduler, self.abort = hotset, scheduler, abort

    def read(self, name: str, path: str | Path, *, roots: Sequence[str | Path] | None = None) -> LoRAAdapter:
        """Read and validate a PEFT folder for `load` (fits the bank; with `roots`, every file must
        resolve inside one of them). Touches no engine state: call it on any thread, e.g. a server's
        `asyncio.to_thread`, then `load(name, adapter)` on the engine thread."""
        return self.hotset.read(name, path, roots)

    def load(self, name: str, source: str | Path | LoRAAdapter, *, roots: Sequence[str | Path] | None = None) -> None:
        """Register an adapter at run time: a PEFT folder (read and validated here, on this thread) or an
        adapter from `read`. Loaded into a free slot if there is one. `roots` confine every later
        re-read of the folder (an adapter from `read` keeps the roots it was read with). Refused, with
        nothing changed, for a bad folder, a name in use, or a name still draining. With a per-request chooser,
        it is recalibrated in one go (`load_stages`)."""
        from molora.routing.hybrid import drain

        drain(self.load_stages(name, source, roots=roots))

    def load_stages(
        self, name: str, source: str | Path | LoRAAdapter, *, roots: Sequence[str | Path] | None = None
    ) -> Generator[None, None, None]:
        """`load` in stages for the engine thread to run one at a time between steps (a server's load).
        Without a chooser: one stage, the registration. With one (module docstring): the registration, then the
        chooser's calibration of the new adapter over its pool, one forward pass per stage (none when its
        statistics are cached: the calibration cache keys them by the adapter's contents), then the swap. Raises,
        with the adapter unregistered again and the chooser as it was: BankFullError when the chooser's adapters
        would outnumber the slots (it runs them all in slots at once; checked before anything changes) or none
        can be freed for the new one, MoLoRAError when the chooser cannot score it (non-finite entropies),
        CalibrationError for any other failure of the calibration. Closing the generator half-way rolls back too.
        Loads and unloads must not interleave with one (a server runs them one at a time)."""
        hs = self.hotset
        mm, current = hs.mm, getattr(hs.mm, "chooser", None)
        calibration = getattr(mm, "calibration", None)
        if current is None or calibration is None:
            hs.register(name, source, roots)
            return
        names = [*_choosable(current, hs, leave_out=name), name]
        if len(names) > mm.bank.num_slots:
            raise BankFullError(
                f"--router hybrid: the chooser runs every adapter it chooses among in a slot at once, and with "
                f"{name!r} that would be {len(names)} adapters ({names}) for the bank's {mm.bank.num_slots} slots; "
                "unload one first, or serve with more slots (--max-loras)"
            )
        hs.register(name, source, roots)
        pinned = done = False
        try:
            while not hs.acquire([name]):
                if name not in hs.reads:  # not a read in flight (the CPU tier had no room): slots are short
                    raise BankFullError(
                        f"no slot can be freed to calibrate the chooser on adapter {name!r} (every slot is pinned "
                        "by running requests); retry shortly"
                    )
                yield None  # its read finishes on the loader thread
            pinned = True
            try:
                new = yield from calibration.rebuild_stages(mm, current, names, fresh=[name])
            except MoLoRAError as e:  # the adapter's own fault (non-finite entropies): a bad adapter for the chooser
                raise AdapterError(
                    f"--router hybrid: the chooser cannot be calibrated on adapter {name!r} ({e}); it was not loaded"
                ) from e
            if mm.chooser is not current:
                raise AdapterError(f"the chooser changed while it was calibrated on {name!r}; load it again")
            done = True
        except (MoLoRAError, GeneratorExit):
            raise
        except Exception as e:
            raise CalibrationError(
                f"--router hybrid: calibrating the chooser on adapter {name!r} failed ({type(e).__name__}: {e}); "
                "the adapter was not loaded and the chooser is unchanged"
            ) from e
        finally:
            if pinned:
                hs.release([name])
            if not done:
                hs.unregister(name)
                log.info("adapter %r unregistered again: the chooser could not be calibrated on it", name)
        mm.chooser = new  # the swap: one reference, between two engine steps
        log.info("--router hybrid: the chooser now chooses among %s", names)

    def register(self, folders: Mapping[str, str | Path], *, roots: Sequence[str | Path] | None = None) -> None:
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

    def unload(self, name: str, force: bool = False) -> str:
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
                self.abort(req.request_id, why)
            if name in hs.paths:  # the last abort already unregistered it if it was draining
                hs.unregister(name)
            log.info("adapter %r unloaded (force), %d request(s) aborted", name, len(users))
            _drop_from_chooser(hs, name)
            return "unloaded"
        if not users:
            hs.unregister(name)
            state = "unloaded"
        else:
            if name not in hs.draining:
                hs.drain(name)
                log.info("adapter %r draining: %d request(s) in flight use it", name, len(users))
            state = "draining"
        _drop_from_chooser(hs, name)
        return state

    def describe(self) -> list[dict]:
        """name, path, slot (or None), tier ("slot" | "cpu" | "disk"), pin count and state ("ready" |
        "loading": a background read is in flight | "draining": being unloaded) of every adapter."""
        return self.hotset.describe()


def _choosable(chooser: Any, hs: HotSet, leave_out: str | None = None) -> list[str]:
    """The chooser's adapters that are still registered and not draining (but `leave_out`), in its order."""
    return [n for n in chooser.adapter_names if n != leave_out and n in hs.paths and n not in hs.draining]


def _drop_from_chooser(hs: HotSet, name: str) -> None:
    """After `name` was unloaded (or began draining): the model's chooser rebuilt without it, no forward pass (the
    others keep their statistics and prototypes). When no adapter is left, the chooser stays: every adapter it knows
    is gone, so it picks the base model for every prompt (molora.engine.admission.chooser_stages asks only
    registered ones). A rebuild that fails is logged and the old chooser stays, which never picks `name` either."""
    from molora.routing.hybrid import drain

    mm = hs.mm
    current, calibration = getattr(mm, "chooser", None), getattr(mm, "calibration", None)
    if current is None or calibration is None or name not in current.adapter_names:
        return
    names = _choosable(current, hs)
    if not names:
        log.info("--router hybrid: no adapter is left to choose among; the chooser picks the base model")
        return
    try:
        mm.chooser = drain(calibration.rebuild_stages(mm, current, names))
    except Exception as e:
        log.error("--router hybrid: the chooser could not be rebuilt without %r (%s: %s)", name, type(e).__name__, e)
        return
    log.info("--router hybrid: the chooser now chooses among %s", names)
