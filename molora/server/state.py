"""What the routes of the app share (`ServerState`, `app.state.molora`), and adapter management on it.

`ServerState` holds the engine client, metrics, catalog, keys, adapter roots, limits and the drain flag; it
answers /health and /ready, turns engine events into metrics, loads and unloads adapters for the admin routes
(`load_adapter`, `unload_adapter`: the files are read and checked off the engine thread, confined to the adapter
roots by `resolve_adapter_path`) and resolves an unknown model name to a folder of a --lora-resolver-dir on first
use (`resolve_lora`, vLLM's filesystem resolver). Knows nothing of routes, auth headers or FastAPI
(molora.server.app).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from molora.errors import AdapterDraining, BankFullError, CalibrationError, MoLoRAError, RoutingError
from molora.server.catalog import Catalog, ModelInfo
from molora.server.client import EngineClient
from molora.server.generation import Generation, Limits
from molora.server.metrics import ServerMetrics
from molora.server.protocol import APIError
from molora.server.tenants import TenantLimits, Tenants, parse_api_keys

log = logging.getLogger("molora.server")

ADAPTER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,63}")  # what an adapter may be called (AdapterLoadRequest)


class ServerState:
    """Everything the routes share; `app.state.molora`."""

    def __init__(
        self,
        client: EngineClient,
        metrics: ServerMetrics,
        catalog: Catalog,
        *,
        api_keys: Sequence[str],
        admin_keys: Sequence[str],
        adapter_roots: Sequence[Path],
        max_body_bytes: int,
        retry_after_s: int,
        limits: Limits = Limits(),
        resolver_dirs: Sequence[Path] = (),
        tenant_limits: TenantLimits = TenantLimits(),
    ) -> None:
        self.client, self.metrics, self.catalog = client, metrics, catalog
        api, admin = parse_api_keys(api_keys), parse_api_keys(admin_keys)  # NAME=KEY: the key's tenant name
        self.key_names = {**api, **admin}
        self.api_keys = tuple(api) + tuple(admin)  # an admin key is also an API key
        self.admin_keys = tuple(admin)
        self.tenants = Tenants(tenant_limits)
        self.adapter_roots = tuple(adapter_roots)
        self.max_body_bytes = max_body_bytes
        self.retry_after_s = retry_after_s
        self.draining = False
        self.resolver_dirs = tuple(resolver_dirs)
        self._resolving: dict[str, asyncio.Lock] = {}
        self.generation = Generation(
            client,
            metrics,
            catalog,
            limits,
            resolver=self.resolve_lora if self.resolver_dirs else None,
            tenants=self.tenants,
            retry_after_s=retry_after_s,
        )

    async def resolve_lora(self, name: str) -> bool:
        """vLLM's filesystem LoRA resolver: a request naming an unknown model NAME loads the PEFT folder
        DIR/NAME of a --lora-resolver-dir on first use (read off the engine thread; its weights are not read
        before). False when no such folder exists; a folder that is not a valid adapter answers 400."""
        if not ADAPTER_NAME.fullmatch(name):
            return False
        found = next(
            (
                d / name
                for d in self.resolver_dirs
                if (d / name / "adapter_config.json").is_file() and (d / name).resolve().is_relative_to(d)
            ),
            None,
        )
        if found is None:
            return False
        async with self._resolving.setdefault(name, asyncio.Lock()):  # one load when many ask at once
            if any(name in info.adapters for info in self.catalog):
                return True
            await self.load_adapter(None, name, str(found), param="model", roots=self.resolver_dirs)
        log.info("adapter %r resolved from %s on first use", name, found)
        return True

    def health(self) -> tuple[bool, bool, dict]:
        """(live, ready, details) for /health and /ready (module docstring)."""
        h = self.client.health()
        live = h["alive"] and not h["stalled"] and h["broken"] is None
        if h["broken"] is not None:
            status = "broken"
        elif h["stalled"]:
            status = "stalled"
        elif not h["alive"]:
            status = "engine thread stopped" if self.client.started else "starting"
        else:
            status = "draining" if self.draining else "ok"
        ready = live and not self.draining
        details = {
            "status": status,
            "in_flight": self.client.in_flight,
            "broken": h["broken"],
            "last_progress_age_s": round(h["last_progress_age_s"], 3),
            "engine_failures": h["failures"],
        }
        return live, ready, details

    def on_event(self, kind: str, value: Any) -> None:
        """Engine and runner events -> metrics (molora.server.runner: on_event)."""
        m = self.metrics
        if kind == "queue_wait":
            m.observe_queue_wait(float(value))
        elif kind == "deadline":
            m.count_deadline(str(value))
        elif kind in ("fault", "isolated", "restart"):
            m.count_engine_failure({"fault": "step"}.get(kind, kind))
        elif kind == "chose":  # the engine's per-request chooser decided a call's questions (molora.engine.choosing)
            adapters, seconds = value
            m.observe_choices(list(adapters), float(seconds))
        elif kind == "chooser_failed":
            for _ in range(int(value[0])):
                m.count_choice_failure()
        elif kind == "quarantined":  # the engine unloaded an adapter that gave non-finite logits: new requests 404
            m.count_engine_failure("quarantine")
            m.forget_adapter(str(value))
            for info in self.catalog:
                if value in info.adapters:
                    info.adapters = [a for a in info.adapters if a != value]
                    info.adapter_paths.pop(str(value), None)

    def begin_drain(self) -> None:
        """From now on new requests get 503; the ones in flight go on to the end."""
        self.draining = True

    async def add_mix(
        self, bundle: str | None, name: str, adapters: dict[str, float], router_expert: bool | None = None
    ) -> ModelInfo:
        """Register the named mix `name` -> `adapters` in `bundle` (POST /v1/mixes); 400 naming the field for a name
        that is a served model's or an adapter's, an unknown adapter, a weight out of bounds or too many adapters, or
        a mix the router cannot take as an expert (router_expert: Engine.add_mix)."""
        info = self.catalog.bundle(bundle)
        if name in self.catalog.infos or name in info.adapters:
            raise APIError(
                400, f"mix name {name!r} is already a model's or an adapter's name; choose another", param="name"
            )
        try:
            await self.client.add_mix(info.name, name, adapters, router_expert)
        except RoutingError as e:
            param = {"name": "name", "router_experts": "router_expert"}.get(str(e.field), "adapters")
            raise APIError(400, str(e), param=param) from e
        except MoLoRAError as e:
            raise APIError(400, str(e), param="adapters") from e
        info.mixes[name] = dict(adapters)
        return info

    async def load_adapter(
        self, bundle: str | None, name: str, path: str, *, param: str, roots: Sequence[Path] | None = None
    ) -> ModelInfo:
        """Load the PEFT folder `path` (confined to `roots`, default the adapter roots) as adapter `name` of
        `bundle`; 4xx otherwise. With --router hybrid it returns once the chooser has been recalibrated with the
        adapter; a calibration that fails leaves nothing changed and answers 500 chooser_calibration_failed (400
        invalid_adapter when the adapter is the cause, 409 no_free_slot when the chooser would outgrow the slots)."""
        roots = self.adapter_roots if roots is None else tuple(roots)
        info = self.catalog.bundle(bundle)
        if name in info.adapters:
            raise APIError(
                409, f"adapter {name!r} is already loaded; unload it first", param=param, code="adapter_exists"
            )
        if name in self.catalog.infos:
            raise APIError(400, f"adapter name {name!r} is the served model's own name; choose another", param=param)
        if name in info.mixes:
            raise APIError(400, f"adapter name {name!r} is a named mix's; choose another", param=param)
        path_param = "path" if param == "name" else "lora_path"  # the body's own field names (/v1/adapters, vLLM's)
        resolved = resolve_adapter_path(path, roots, param=path_param)
        try:  # the client reads and checks the files off the engine thread, confined to the roots
            await self.client.load_adapter(info.name, name, resolved, roots)
        except BankFullError as e:
            raise APIError(409, str(e), param=param, code="no_free_slot") from e
        except AdapterDraining as e:
            raise APIError(409, str(e), param=param, code="adapter_draining") from e
        except CalibrationError as e:  # --router hybrid: not the adapter's fault; nothing was changed
            raise APIError(500, str(e), type="server_error", code="chooser_calibration_failed") from e
        except MoLoRAError as e:
            raise APIError(400, str(e), param=path_param, code="invalid_adapter") from e
        self.metrics.known_adapter(name)
        await self.refresh_adapters(info)
        return info

    async def unload_adapter(
        self, bundle: str | None, name: str, force: bool, *, param: str = "name"
    ) -> tuple[ModelInfo, str]:
        """Unload (drain; force: now) adapter `name` of `bundle`: (bundle, "unloaded" | "draining"); 404 if
        unknown. Errors name `param`, the field that gave the name."""
        info = self.catalog.bundle(bundle)
        known = [a["name"] for a in await self.client.list_adapters(info.name)]
        if name not in known:
            raise APIError(
                404, f"adapter {name!r} is not loaded; loaded: {info.adapters}", param=param, code="adapter_not_found"
            )
        try:
            state = await self.client.unload_adapter(info.name, name, force)
        except MoLoRAError as e:
            raise APIError(409, str(e), param=param, code="adapter_busy") from e
        self.metrics.forget_adapter(name)
        await self.refresh_adapters(info)
        return info, state

    async def refresh_adapters(self, info: ModelInfo) -> None:
        """The adapters new requests may name: loaded ones that are not draining."""
        listed = await self.client.list_adapters(info.name)
        info.adapters = [a["name"] for a in listed if a.get("state", "ready") != "draining"]
        info.adapter_paths = {a["name"]: path_text(a.get("path")) for a in listed}


def path_text(path: Any) -> str | None:
    """A listed adapter's path as /v1/models shows it (None: given in memory)."""
    return None if path is None else str(path)


def resolve_adapter_path(path: str, roots: Sequence[Path], *, param: str = "path") -> Path:
    """The adapter folder `path` names, resolved (symlinks and '..' followed), if it lies under a root; errors name
    `param`, the body field that gave the path.

    Relative paths are taken relative to each root in turn; absolute ones must resolve inside a root.
    """
    if not roots:
        raise APIError(
            403,
            "loading adapters at run time is disabled: start the server with --adapter-root DIR",
            param=param,
            code="adapter_loading_disabled",
        )
    given = Path(path)
    try:
        candidates = [given.resolve()] if given.is_absolute() else [(root / given).resolve() for root in roots]
    except (OSError, ValueError, RuntimeError) as e:  # null bytes, symlink loops
        raise APIError(400, f"adapter path {path!r} is not a valid path ({e})", param=param) from e
    inside = [c for c in candidates if any(c.is_relative_to(root) for root in roots)]
    if not inside:
        raise APIError(
            403,
            f"adapter path {path!r} lies outside the adapter roots; give a folder under one of "
            f"{[str(r) for r in roots]}",
            param=param,
            code="path_outside_roots",
        )
    found = next((c for c in inside if (c / "adapter_config.json").is_file()), None)
    if found is None:
        raise APIError(
            404,
            f"no PEFT adapter (adapter_config.json) at {path!r} under the adapter roots",
            param=param,
            code="adapter_not_found",
        )
    return found
