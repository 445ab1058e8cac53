"""The FastAPI application: the routes, and the app that puts them behind the guards (molora.server.guards).

    app = create_app(engine, model_name="molora-default", api_keys=("sk-...",), adapter_roots=("adapters",))
    app = build_app(client, catalog, ...)   # any EngineClient (molora.server.client), e.g. Ray Serve's

Owns: the HTTP surface (`/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/v1/adapters`, `/v1/mixes`,
`/health`, `/ready`, `/metrics`), Bearer-key checks (any key for the API, an admin key for loading and
unloading adapters), adapter paths confined to the configured roots, OpenAI-style error JSON for every
failure (never FastAPI's 422), the body-size limit, the 429/503 answers with Retry-After, and the drain flag
that turns new requests away with 503 while in-flight ones finish. The engine thread starts with the app's
lifespan and stops with it.

Health: `/health` is liveness: 503 when the engine thread is gone, broken by repeated failures, or stalled (busy
with no progress for `stall_s`: a hung step); 200 otherwise, also while draining. `/ready` is readiness: 503 also
while the engine thread has not started or the server drains. Endpoints that need the engine thread
(`/v1/adapters`) wait at most `engine_call_timeout_s`, then answer 503 (`engine_busy`); `/metrics` then answers
without the engine's figures (`molora_engine_healthy` tells why). Adapter loads read and check the files on a
worker thread (`Engine.read_adapter`); only the registration runs on the engine thread (with `--router hybrid`,
then the chooser's calibration on the new adapter, one forward pass between two steps: `Engine.load_adapter_stages`;
docs/serving.md says what its failures answer). `DELETE
/v1/adapters/{name}` drains: new requests stop using the adapter at once and it unloads when the last request
using it ends (202 "draining"); `?force=true` ends those requests with an error and unloads now.

The app reaches engines only through an `EngineClient` (`molora.server.client`): `create_app(engine)` wraps
one in-process engine in a `LocalClient`; `molora.server.ray_serve` builds the same app over engine replicas.
Knows nothing of how an engine is built or of uvicorn (that is `molora.server.launch`), nor of what the
generation endpoints do inside (`molora.server.generation`). What the routes share, and adapter loading and
unloading on it, is `ServerState` (molora.server.state); what stands in front of every route (key checks, body
limit and parsing, the drain gate, the error JSON) is molora.server.guards.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from starlette.responses import JSONResponse, PlainTextResponse, Response

from molora.bundle import stop_token_ids
from molora.config import (
    DEFAULT_MAX_ARRAY_ITEMS,
    DEFAULT_MAX_NUMBER_DIGITS,
    DEFAULT_MAX_OBJECT_PROPERTIES,
    DEFAULT_MAX_STRING_CHARS,
)
from molora.server.catalog import Catalog, ModelInfo
from molora.server.client import EngineClient, LocalClient
from molora.server.generation import Limits
from molora.server.guards import Gate, add_error_handlers, auth, can_see_paths, parse_body
from molora.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from molora.server.metrics import ServerMetrics
from molora.server.openapi import hoist_defs, json_body
from molora.server.protocol import (
    AdapterLoadRequest,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    MixRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
)
from molora.server.runner import EngineBusy, EngineRunner, RunnerStopped
from molora.server.state import ServerState, path_text, resolve_adapter_path
from molora.server.tenants import TenantLimits

__all__ = ["MAX_BODY_BYTES", "ServerState", "build_app", "create_app", "model_info", "resolve_adapter_path"]

MAX_BODY_BYTES = 4 << 20


def create_app(
    engine: Any,
    *,
    model_name: str | None = None,
    api_keys: Sequence[str] = (),
    admin_keys: Sequence[str] = (),
    adapter_roots: Sequence[str | Path] = (),
    max_queue: int = 256,
    max_model_len: int | None = None,
    default_max_tokens: int = 512,
    max_body_bytes: int = MAX_BODY_BYTES,
    retry_after_s: int = 1,
    limits: Limits = Limits(),
    stall_s: float = 30.0,
    engine_call_timeout_s: float = 10.0,
    lora_resolver_dirs: Sequence[str | Path] = (),
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
    allow_special_tokens_in_chat: bool = False,
    max_json_string_chars: int | None = DEFAULT_MAX_STRING_CHARS,
    max_json_array_items: int | None = DEFAULT_MAX_ARRAY_ITEMS,
    max_json_object_properties: int | None = DEFAULT_MAX_OBJECT_PROPERTIES,
    max_json_number_digits: int | None = DEFAULT_MAX_NUMBER_DIGITS,
    tenant_limits: TenantLimits = TenantLimits(),
) -> FastAPI:
    """The OpenAI-compatible app over `engine` (see the module docstring).

    model_name: the served model id (default: the bundle's name, else "molora"); `model_name:adapter` pins
    an adapter. max_queue: engine requests in flight at most (each choice counts); more get 429.
    max_model_len: context length (default: the engine's `max_model_len`). limits: request deadlines, queue
    timeout and SSE keep-alive (molora.server.generation.Limits). stall_s: /health turns 503 when the engine
    thread is busy this long without progress. engine_call_timeout_s: how long /metrics and /v1/adapters wait
    for the engine thread. lora_resolver_dirs: folders whose subfolder NAME loads as adapter NAME when a request
    first names it (vLLM's filesystem resolver). enable_auto_tool_choice, tool_call_parser: vLLM's flags; tool_choice
    "auto" is parsed by that parser (molora.server.tools; default `hermes`), and refused without the first.
    allow_special_tokens_in_chat: read special-token literals in chat messages as special tokens (default: as text,
    molora.server.special_tokens). max_json_string_chars, max_json_array_items, max_json_object_properties,
    max_json_number_digits: structured output closes free strings, unbounded arrays, open objects and numbers (digits
    before the point) at these (None or 0: unbounded; molora.schema_rules.bound_runaways). api_keys: `KEY` or
    `NAME=KEY` (the key's tenant, molora.server.tenants); tenant_limits: per-tenant limits, answered 429.
    """
    from molora.server.tools import auto_tool_parser

    mm = engine.mm
    bundle = getattr(mm, "bundle", None)
    listed = engine.list_adapters()
    info = model_info(
        model_name or (bundle.name if bundle is not None else "molora"),
        engine.tokenizer,
        bundle,
        config=getattr(mm, "config", None),
        max_model_len=max_model_len or engine.max_model_len,
        adapters=[a["name"] for a in listed],
        default_max_tokens=default_max_tokens,
    )
    info.adapter_paths = {a["name"]: path_text(a.get("path")) for a in listed}
    book = getattr(engine, "mixes", None)  # named mixes (molora.routing.mix.MixBook); None: an engine without them
    info.mixes = {} if book is None else {name: dict(mix) for name, mix in book.items()}
    info.chooser = "hybrid" if getattr(mm, "chooser", None) is not None else None
    info.tool_parser = auto_tool_parser(enable_auto_tool_choice, tool_call_parser)
    info.allow_special_tokens_in_chat = allow_special_tokens_in_chat
    info.max_json_string_chars, info.max_json_array_items = max_json_string_chars or None, max_json_array_items or None
    info.max_json_object_properties = max_json_object_properties or None
    info.max_json_number_digits = max_json_number_digits or None
    runner = EngineRunner(engine, max_in_flight=max_queue, stall_s=stall_s)
    return build_app(
        LocalClient(engine, runner, call_timeout_s=engine_call_timeout_s),
        Catalog([info]),
        api_keys=api_keys,
        admin_keys=admin_keys,
        adapter_roots=adapter_roots,
        max_body_bytes=max_body_bytes,
        retry_after_s=retry_after_s,
        limits=limits,
        lora_resolver_dirs=lora_resolver_dirs,
        tenant_limits=tenant_limits,
    )


def model_info(
    name: str,
    tokenizer: Any,
    bundle: Any,
    *,
    config: Any = None,
    max_model_len: int | None,
    adapters: Sequence[str],
    default_max_tokens: int = 512,
) -> ModelInfo:
    """What the endpoints need to know of one served bundle (`bundle` may be None: a bare model)."""
    return ModelInfo(
        name=name,
        tokenizer=tokenizer,
        stop_token_ids=tuple(stop_token_ids(tokenizer, bundle)),
        vocab_size=_vocab_size(tokenizer, config),
        max_model_len=max_model_len,
        prompt_template=bundle.prompt_template if bundle is not None else None,
        adapters=list(adapters),
        default_max_tokens=default_max_tokens,
    )


def build_app(
    client: EngineClient,
    catalog: Catalog,
    *,
    api_keys: Sequence[str] = (),
    admin_keys: Sequence[str] = (),
    adapter_roots: Sequence[str | Path] = (),
    max_body_bytes: int = MAX_BODY_BYTES,
    retry_after_s: int = 1,
    limits: Limits = Limits(),
    lora_resolver_dirs: Sequence[str | Path] = (),
    tenant_limits: TenantLimits = TenantLimits(),
) -> FastAPI:
    """The OpenAI-compatible app over any `EngineClient` serving the bundles of `catalog` (create_app's
    arguments of the same names)."""
    metrics = ServerMetrics()
    state = ServerState(
        client,
        metrics,
        catalog,
        api_keys=api_keys,
        admin_keys=admin_keys,
        adapter_roots=[Path(r).resolve() for r in adapter_roots],
        max_body_bytes=max_body_bytes,
        retry_after_s=retry_after_s,
        limits=limits,
        resolver_dirs=[Path(r).resolve() for r in lora_resolver_dirs],
        tenant_limits=tenant_limits,
    )
    client.attach(on_step=metrics.observe_step, on_event=state.on_event)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client.start()
        try:
            yield
        finally:
            state.begin_drain()
            client.stop()

    app = FastAPI(
        title="molora",
        version="0.1.0",
        lifespan=lifespan,
        description="OpenAI-compatible serving of one base model with per-token LoRA routing.",
    )
    app.state.molora = state
    add_error_handlers(app, state)
    _add_routes(app, state)
    hoist_defs(app)  # the hand-parsed bodies' schemas (json_body) in app.openapi()
    app.add_middleware(Gate, state=state)
    return app


# ---------------------------------------------------------------------------------------------- routes


def _add_routes(app: FastAPI, s: ServerState) -> None:
    api, admin = Depends(auth(s, admin=False)), Depends(auth(s, admin=True))

    @app.post("/v1/completions", dependencies=[api], openapi_extra=json_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await s.generation.completions(await parse_body(request, CompletionRequest, s), request)

    @app.post("/v1/chat/completions", dependencies=[api], openapi_extra=json_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await s.generation.chat(await parse_body(request, ChatCompletionRequest, s), request)

    @app.get("/v1/models", dependencies=[api])
    async def models(request: Request, limit: int | None = None, after: str | None = None) -> ModelList:
        full = _model_list(s, paths=can_see_paths(s, request))
        return full if limit is None and after is None else _page(full, limit, after)

    @app.get("/v1/models/{model_id:path}", dependencies=[api])
    async def model(request: Request, model_id: str) -> ModelCard:
        info, adapter = s.catalog.resolve(model_id)
        return next(
            card
            for card in _model_list(s, paths=can_see_paths(s, request)).data
            if (card.parent or card.id) == info.name
            and (card.adapter == adapter if card.mix is None else card.id in (adapter, f"{info.name}:{adapter}"))
        )

    @app.get("/health")
    async def health() -> JSONResponse:
        live, _, details = s.health()
        return JSONResponse(details, status_code=200 if live else 503)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        _, ok, details = s.health()
        return JSONResponse(
            details, status_code=200 if ok else 503, headers=None if ok else {"Retry-After": str(s.retry_after_s)}
        )

    @app.get("/metrics", dependencies=[api])
    async def metrics() -> PlainTextResponse:
        live, ready, details = s.health()
        try:
            stats = await s.client.stats()
        except (EngineBusy, RunnerStopped):  # the server's own metrics matter most exactly then
            stats = {}
        text = s.metrics.render(
            stats,
            in_flight=s.client.in_flight,
            max_in_flight=s.client.max_in_flight,
            draining=s.draining,
            ready=ready,
            engine_healthy=live,
            last_step_age_s=details["last_progress_age_s"],
        )  # bare names: the model ids
        # requests send for a pinned adapter, as vLLM's (Catalog.adapter_id)
        return PlainTextResponse(text, media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/adapters", dependencies=[api])
    async def list_adapters(request: Request, bundle: str | None = None) -> JSONResponse:
        infos = [s.catalog.bundle(bundle)] if bundle is not None else list(s.catalog)
        data = [{**a, "bundle": info.name} for info in infos for a in await s.client.list_adapters(info.name)]
        if not can_see_paths(s, request):  # a user key sees names, never where the files lie
            data = [{k: v for k, v in a.items() if k != "path"} for a in data]
        return JSONResponse({"object": "list", "data": jsonable_encoder(data)})

    @app.post("/v1/adapters", dependencies=[admin], status_code=201, openapi_extra=json_body(AdapterLoadRequest))
    async def load_adapter(request: Request) -> JSONResponse:
        req = await parse_body(request, AdapterLoadRequest, s)
        info = await s.load_adapter(req.bundle, req.name, req.path, param="name")
        return JSONResponse(
            {
                "object": "adapter",
                "name": req.name,
                "model": f"{info.name}:{req.name}",
                "bundle": info.name,
                "loaded": True,
            },
            status_code=201,
        )

    @app.delete("/v1/adapters/{name}", dependencies=[admin])
    async def unload_adapter(name: str, force: bool = False, bundle: str | None = None) -> JSONResponse:
        info, state = await s.unload_adapter(bundle, name, force)
        done = state == "unloaded"
        return JSONResponse(
            {"object": "adapter", "name": name, "bundle": info.name, "deleted": done, "state": state},
            status_code=200 if done else 202,
        )

    @app.post("/v1/mixes", dependencies=[admin], status_code=201, openapi_extra=json_body(MixRequest))
    async def add_mix(request: Request) -> JSONResponse:
        req = await parse_body(request, MixRequest, s)
        info = await s.add_mix(req.bundle, req.name, dict(req.adapters), req.router_expert)
        body = {"object": "mix", "name": req.name, "adapters": info.mixes[req.name], "bundle": info.name}
        if req.router_expert is not None:
            body["router_expert"] = req.router_expert
        return JSONResponse({**body, "model": s.catalog.adapter_id(info, req.name)}, status_code=201)

    # vLLM's runtime LoRA endpoints (what inference gateways and LoRA-aware routers call): plain-text success
    @app.post("/v1/load_lora_adapter", dependencies=[admin], openapi_extra=json_body(LoadLoRAAdapterRequest))
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        req = await parse_body(request, LoadLoRAAdapterRequest, s)
        if req.load_inplace:
            raise APIError(
                400,
                "load_inplace is not supported: unload the adapter (/v1/unload_lora_adapter), then "
                "load the new weights",
                param="load_inplace",
            )
        await s.load_adapter(None, req.lora_name, req.lora_path, param="lora_name")
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=[admin], openapi_extra=json_body(UnloadLoRAAdapterRequest))
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        req = await parse_body(request, UnloadLoRAAdapterRequest, s)
        _, state = await s.unload_adapter(None, req.lora_name, False, param="lora_name")
        if state == "unloaded":
            return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
        return PlainTextResponse(
            f"Success: LoRA adapter '{req.lora_name}' is draining: new requests no longer use "
            "it and it unloads when the requests using it end."
        )


MAX_MODELS_PAGE = 1000


def _page(full: ModelList, limit: int | None, after: str | None) -> ModelList:
    """One page of `full`: the models after the id `after` (none: from the first), at most `limit` of them."""
    if limit is not None and not 1 <= limit <= MAX_MODELS_PAGE:
        raise APIError(400, f"limit={limit}: give 1..{MAX_MODELS_PAGE} models per page", param="limit")
    data = full.data
    if after is not None:
        ids = [card.id for card in data]
        if after not in ids:
            raise APIError(
                400,
                f"after={after!r} is not a model id of this server (it may have been unloaded); "
                "start again without after",
                param="after",
            )
        data = data[ids.index(after) + 1 :]
    page = data if limit is None else data[:limit]
    return ModelList(
        data=page,
        first_id=page[0].id if page else None,
        last_id=page[-1].id if page else None,
        has_more=len(page) < len(data),
    )


def _model_list(s: ServerState, *, paths: bool) -> ModelList:
    """Every served model; an adapter's `root` is its folder when `paths` (admin keys, open servers), else None."""
    created = int(s.metrics.started)
    cards = []
    for info in s.catalog:
        cards.append(ModelCard(id=info.name, created=created, root=info.name, max_model_len=info.max_model_len))
        cards += [
            ModelCard(
                id=s.catalog.adapter_id(info, a),
                created=created,
                adapter=a,
                parent=info.name,
                root=info.adapter_paths.get(a) if paths else None,
                max_model_len=info.max_model_len,
            )
            for a in info.adapters
        ]
        cards += [
            ModelCard(
                id=s.catalog.adapter_id(info, m),
                created=created,
                parent=info.name,
                mix=mix,
                max_model_len=info.max_model_len,
            )
            for m, mix in sorted(info.mixes.items())
            if m not in info.adapters
        ]
    return ModelList(data=cards)


# ---------------------------------------------------------------------------------------------- model facts


def _vocab_size(tok: Any, config: Any) -> int:
    sizes = [len(tok)] + ([config.vocab_size] if getattr(config, "vocab_size", None) else [])
    return min(sizes)
