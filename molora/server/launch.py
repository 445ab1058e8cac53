"""`serve()`: build the engine from a bundle and run the app under uvicorn, draining on SIGTERM.

Owns: loading (`molora.bundle.load` -> `Engine`), the uvicorn configuration, and the drain on SIGTERM or
Ctrl-C: the app starts answering new requests with 503 at once, uvicorn stops accepting connections,
requests in flight run to the end (up to `drain_timeout_s`, then they are cancelled and their engine
requests aborted), the engine thread stops and the process exits. Once the engine is built, the heap is
frozen out of Python's full collections (molora.engine.heap; not under Ray, whose replicas build and drop
bundles' engines). `ServerThread` runs the same server on a background thread (tests, benchmarks). Knows
nothing of the routes themselves.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from molora.config import (
    DEFAULT_MAX_ARRAY_ITEMS,
    DEFAULT_MAX_NUMBER_DIGITS,
    DEFAULT_MAX_OBJECT_PROPERTIES,
    DEFAULT_MAX_STRING_CHARS,
)
from molora.engine.heap import freeze_heap
from molora.errors import MoLoRAError
from molora.server.app import create_app
from molora.server.http_timeouts import protocol_class
from molora.server.state import ADAPTER_NAME

log = logging.getLogger("molora.server")


class DrainingServer(uvicorn.Server):
    """uvicorn's server that flips the app into draining mode the moment a shutdown signal arrives."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self.molora_app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.molora_app.state.molora.begin_drain()
        log.warning(
            "signal %d: draining %d in-flight requests, then exiting",
            sig,
            self.molora_app.state.molora.client.in_flight,
        )
        super().handle_exit(sig, frame)


def build_engine(
    bundle: Any = None,
    engine_config: Any = None,
    dtype: str = "float32",
    max_cpu_loras: int | None = None,
    quantization: str | None = None,
    quantize_lm_head: bool | None = None,
) -> Any:
    """An `Engine` over the bundle at `bundle` (a folder, a parsed `Bundle` such as `molora serve --model` makes,
    or None: the embedded default bundle); dtype "bfloat16" runs weights, adapters and KV cache in bf16 (AMX /
    avx512_bf16 on CPU; the router's gates stay fp32). max_cpu_loras (vLLM's flag): the CPU tier holds that
    many adapters of the slots' size beyond the slots (instead of EngineConfig.cpu_tier_bytes). quantization
    ("int8", "int4", "w8a8", vLLM's --quantization): the base's linears quantized on load (molora.bundle.load);
    quantize_lm_head: the LM head too (int8 or w8a8; molora.attach)."""
    import dataclasses

    import torch

    from molora.bundle import attach_chooser, load
    from molora.engine import Engine, EngineConfig

    mm = load(bundle, quantization=quantization, quantize_lm_head=quantize_lm_head, chooser=False)
    if dtype != "float32":
        mm.to(getattr(torch, dtype))
    attach_chooser(mm)  # --router hybrid: its calibration, in the dtype it serves in (cached on disk)
    cfg = engine_config if engine_config is not None else EngineConfig()
    if max_cpu_loras is not None:
        if max_cpu_loras < 0:
            raise MoLoRAError(f"--max-cpu-loras {max_cpu_loras}: must be 0 or more")
        cfg = dataclasses.replace(cfg, cpu_tier_bytes=max_cpu_loras * mm.bank.slot_nbytes())
    return Engine(mm, cfg)


def scan_lora_dirs(dirs: Sequence[str | Path]) -> list[tuple[Path, dict[str, Path]]]:
    """(folder, {name: subfolder}) of each of `dirs` (resolved): its PEFT subfolders by name, nothing read but
    which files exist. MoLoRAError for a missing folder, a subfolder name an adapter may not have, or a name found in
    two of the folders."""
    from molora.adapters.io import scan_adapter_dir

    out: list[tuple[Path, dict[str, Path]]] = []
    seen: dict[str, Path] = {}
    for d in dirs:
        root = Path(d).resolve()
        found = scan_adapter_dir(root)
        bad = [n for n in found if not ADAPTER_NAME.fullmatch(n)]
        if bad:
            raise MoLoRAError(
                f"--lora-dir {d}: subfolder names {bad[:8]} are not adapter names (letters, digits, '_', '.', '-'; "
                "at most 64); rename them"
            )
        twice = sorted(n for n in found if n in seen)
        if twice:
            raise MoLoRAError(f"--lora-dir {d}: adapters {twice[:8]} are also in {seen[twice[0]]}; rename one")
        seen.update(dict.fromkeys(found, root))
        out.append((root, found))
    return out


def register_lora_dirs(engine: Any, dirs: Sequence[str | Path]) -> list[str]:
    """Register every PEFT subfolder of each of `dirs` as an adapter named after it, reading only its
    `adapter_config.json` (`Engine.register_adapters`: the weights on first use); each folder confines its own
    adapters' reads. Returns the names, in order. MoLoRAError (nothing registered) for a missing folder, a subfolder
    name an adapter may not have or found twice (`scan_lora_dirs`); AdapterError (nothing registered from that folder
    on) for a name already taken or a bad config."""
    names: list[str] = []
    for root, found in scan_lora_dirs(dirs):
        engine.register_adapters(found, roots=[root])
        names += list(found)
        log.info("--lora-dir %s: %d adapters registered (weights read on first use)", root, len(found))
    return names


def serve(
    bundle: Any = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_keys: Sequence[str] = (),
    admin_keys: Sequence[str] = (),
    adapter_roots: Sequence[str | Path] = (),
    engine_config: Any = None,
    max_queue: int = 256,
    model_name: str | None = None,
    drain_timeout_s: float = 30.0,
    log_level: str = "info",
    engine: Any = None,
    dtype: str = "float32",
    limits: Any = None,
    stall_s: float = 30.0,
    max_cpu_loras: int | None = None,
    lora_resolver_dirs: Sequence[str | Path] = (),
    quantization: str | None = None,
    lora_dirs: Sequence[str | Path] = (),
    quantize_lm_head: bool | None = None,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
    allow_special_tokens_in_chat: bool = False,
    max_json_string_chars: int | None = DEFAULT_MAX_STRING_CHARS,
    max_json_array_items: int | None = DEFAULT_MAX_ARRAY_ITEMS,
    max_json_object_properties: int | None = DEFAULT_MAX_OBJECT_PROPERTIES,
    max_json_number_digits: int | None = DEFAULT_MAX_NUMBER_DIGITS,
    tenant_limits: Any = None,
) -> None:
    """Serve the OpenAI-compatible API until SIGTERM/SIGINT, then drain and return.

    bundle: a bundle folder, a parsed `Bundle` (molora.userbundle.bundle_from_flags) or None (the embedded
    default); engine: an already built engine instead. max_cpu_loras, quantization, quantize_lm_head: see
    `build_engine`.
    lora_resolver_dirs: folders whose subfolder NAME loads as adapter NAME when a request first names it.
    lora_dirs: folders whose every subfolder NAME is adapter NAME from the start (`register_lora_dirs`).
    api_keys / admin_keys: Bearer keys (none: an open server; admin keys also work as API keys).
    adapter_roots: folders that POST /v1/adapters may load from (none: run-time loading disabled).
    limits: request deadlines, queue timeout, SSE keep-alive (molora.server.generation.Limits; None: defaults).
    stall_s: /health turns 503 when the engine thread is busy this long without progress.
    enable_auto_tool_choice, tool_call_parser: tool_choice "auto" and its parser (create_app).
    allow_special_tokens_in_chat: special-token literals in chat messages stay special tokens (create_app).
    max_json_string_chars, max_json_array_items, max_json_object_properties, max_json_number_digits: structured
    output's bounds on free strings, arrays, open objects and numbers (create_app).
    tenant_limits: per-tenant limits (molora.server.tenants.TenantLimits; None: none).
    """
    if not api_keys and not admin_keys and host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s without API keys: anyone who can reach this port can use it (--api-key)", host)
    if engine is None:
        engine = build_engine(bundle, engine_config, dtype, max_cpu_loras, quantization, quantize_lm_head)
    register_lora_dirs(engine, lora_dirs)
    extra = {"limits": limits} if limits is not None else {}
    if tenant_limits is not None:
        extra["tenant_limits"] = tenant_limits
    app = create_app(
        engine,
        model_name=model_name,
        api_keys=api_keys,
        admin_keys=admin_keys,
        adapter_roots=adapter_roots,
        max_queue=max_queue,
        stall_s=stall_s,
        lora_resolver_dirs=lora_resolver_dirs,
        enable_auto_tool_choice=enable_auto_tool_choice,
        tool_call_parser=tool_call_parser,
        allow_special_tokens_in_chat=allow_special_tokens_in_chat,
        max_json_string_chars=max_json_string_chars,
        max_json_array_items=max_json_array_items,
        max_json_object_properties=max_json_object_properties,
        max_json_number_digits=max_json_number_digits,
        **extra,
    )
    log.info("serving %s on http://%s:%d/v1", ", ".join(app.state.molora.catalog.infos), host, port)
    freeze_heap()  # the engine lives as long as the process: keep full collections off it (molora.engine.heap)
    run_app(app, host, port, drain_timeout_s=drain_timeout_s, log_level=log_level)


def run_app(
    app: FastAPI, host: str, port: int, *, drain_timeout_s: float | None = 30.0, log_level: str = "info"
) -> None:
    """Run a molora app under uvicorn until SIGTERM/SIGINT, draining (`DrainingServer`); drain_timeout_s None:
    wait for in-flight requests without a limit. `molora serve` and `molora serve --ray --ray-ingress process`."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=drain_timeout_s,
        access_log=False,
        http=protocol_class(),  # requests' headers must arrive within HEADER_TIMEOUT_S (molora.server.http_timeouts)
    )
    DrainingServer(config, app).run()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ServerThread:
    """The app on a background thread with a live socket: `with ServerThread(app) as url: ...`.

    url is the API base (`http://127.0.0.1:<port>/v1`), as the `openai` client wants it.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.app = app
        self.port = port if port is not None else free_port(host)
        self.host = host
        config = uvicorn.Config(
            app,
            host=host,
            port=self.port,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=5,
            http=protocol_class(),
        )
        self.server = DrainingServer(config, app)
        self.thread = threading.Thread(target=self.server.run, name="molora-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on port {self.port} did not start")
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(15)
