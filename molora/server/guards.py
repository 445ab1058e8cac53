"""What stands between a request and the routes: API keys, the body-size limit, body parsing, the drain gate, and
the OpenAI-style error JSON every failure answers with.

    app.add_middleware(Gate, state=state)          # 503 while draining, 413 by Content-Length, response counts
    add_error_handlers(app, state)                 # APIError, 429 Saturated, 503 busy/stopped, 400, 404, 500
    api = Depends(auth(state, admin=False))        # Bearer key for the API; admin=True for adapter loads
    req = await parse_body(request, CompletionRequest, state)   # 413 over the limit, 400 for bad JSON or fields

Kept apart from molora.server.app (the routes themselves) because none of it depends on what a route does: a new
endpoint gets the same keys, limits and error shapes by being registered behind them. Never FastAPI's 422: a
validation error answers 400 with the field named. Knows `ServerState` (keys, limits, drain flag, metrics) and the
runner's exceptions; nothing of engines, bundles or generation.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Sequence
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from molora.errors import MoLoRAError
from molora.server.protocol import APIError, validation_error
from molora.server.runner import EngineBusy, RunnerStopped, Saturated
from molora.server.state import ServerState

__all__ = [
    "OFFLOAD_BODY_BYTES",
    "ROUTES",
    "Gate",
    "add_error_handlers",
    "auth",
    "can_see_paths",
    "error_response",
    "parse_body",
]

log = logging.getLogger("molora.server")
M = TypeVar("M", bound=BaseModel)

ROUTES = (  # the route labels of the response counts (/metrics); any other path counts as "other"
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/v1/adapters",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/health",
    "/ready",
    "/metrics",
)
OPEN_WHILE_DRAINING = ("/health", "/ready", "/metrics")
OFFLOAD_BODY_BYTES = 256 << 10  # bodies larger than this are parsed on a worker thread


# ---------------------------------------------------------------------------------------------- auth


def auth(s: ServerState, *, admin: bool) -> Any:
    """A FastAPI dependency: 401 without a configured API key (none configured: open), 403 without an admin key
    when `admin`."""

    async def check(request: Request) -> None:
        if not s.api_keys:
            return  # no keys configured: an open local server
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""
        key = _matching(token, s.api_keys) if token else None
        if key is None:
            raise APIError(
                401,
                "missing or invalid API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if admin and not _matches(token, s.admin_keys):
            raise APIError(
                403,
                "loading and unloading adapters needs an admin key (--admin-key)",
                type="permission_error",
                code="admin_key_required",
            )
        request.state.key_name = s.key_names.get(key)  # the tenant a named key (--api-key NAME=KEY) stands for

    return check


def _matches(token: str, keys: Sequence[str]) -> bool:
    return _matching(token, keys) is not None


def _matching(token: str, keys: Sequence[str]) -> str | None:
    """The configured key equal to `token` (compared in constant time against every key), or None."""
    found = None
    for k in keys:
        if hmac.compare_digest(token.encode(), k.encode()):
            found = k
    return found


# ---------------------------------------------------------------------------------------------- bodies


def can_see_paths(s: ServerState, request: Request) -> bool:
    """Whether this request may see filesystem paths (adapter folders): with keys configured, admin keys only; an
    open server (no keys: the operator's own machine) shows them, as vLLM does."""
    if not s.api_keys:
        return True
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and bool(token.strip()) and _matches(token.strip(), s.admin_keys)


# a body must arrive within BODY_GRACE_S plus one second per BODY_RATE_FLOOR bytes: a client that sends a byte now
# and then cannot hold a connection and its handler for long (a 4 MiB body at the floor: 74 s)
BODY_GRACE_S = 10.0
BODY_RATE_FLOOR = 64 << 10  # bytes per second


async def parse_body(request: Request, model: type[M], s: ServerState) -> M:
    """The body validated as `model`; 415 unless it is sent as JSON, 413 over the size limit, 408 when it arrives
    slower than the floor (BODY_RATE_FLOOR), 400 for bad JSON or bad fields."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise APIError(
            415,
            f"Content-Type {media or '(none)'!r}: send the body as JSON with 'Content-Type: application/json'",
            param="Content-Type",
            code="unsupported_media_type",
        )
    raw = bytearray()
    start = asyncio.get_running_loop().time()
    chunks = request.stream().__aiter__()
    while True:
        allowed = start + BODY_GRACE_S + len(raw) / BODY_RATE_FLOOR - asyncio.get_running_loop().time()
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), max(allowed, 0.0))
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise APIError(
                408,
                f"the request body arrived too slowly ({len(raw)} bytes so far; this server reads at least "
                f"{BODY_RATE_FLOOR} bytes/s after {BODY_GRACE_S:g} s)",
                code="body_timeout",
            ) from None
        raw += chunk
        if len(raw) > s.max_body_bytes:
            raise APIError(413, f"request body over {s.max_body_bytes} bytes", code="request_too_large")
    try:
        if len(raw) > OFFLOAD_BODY_BYTES:  # a large body would freeze every stream while it parses
            return await asyncio.to_thread(model.model_validate_json, bytes(raw))
        return model.model_validate_json(bytes(raw))
    except ValidationError as e:
        raise validation_error(e) from None


# ---------------------------------------------------------------------------------------------- errors


def error_response(
    status: int,
    message: str,
    *,
    type: str = "invalid_request_error",
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """An OpenAI-style error body (`APIError.body`) as a response."""
    return JSONResponse(APIError(status, message, type=type, code=code).body(), status_code=status, headers=headers)


def add_error_handlers(app: FastAPI, s: ServerState) -> None:
    retry = {"Retry-After": str(s.retry_after_s)}

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(Saturated)
    async def saturated(_: Request, e: Saturated) -> JSONResponse:
        return error_response(
            429,
            f"the server is at capacity ({e}); retry after {s.retry_after_s} s",
            type="rate_limit_error",
            code="server_busy",
            headers=retry,
        )

    @app.exception_handler(EngineBusy)
    async def busy(_: Request, e: EngineBusy) -> JSONResponse:
        return error_response(503, str(e), type="server_error", code="engine_busy", headers=retry)

    @app.exception_handler(RunnerStopped)
    async def stopped(_: Request, e: RunnerStopped) -> JSONResponse:
        return error_response(
            503, f"the engine is not running ({e})", type="server_error", code="unavailable", headers=retry
        )

    @app.exception_handler(MoLoRAError)
    async def molora_error(_: Request, e: MoLoRAError) -> JSONResponse:
        return error_response(400, str(e))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(
            e.status_code,
            str(e.detail),
            code="not_found" if e.status_code == 404 else None,
            headers=getattr(e, "headers", None),
        )

    @app.exception_handler(RequestValidationError)
    async def request_invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        return error_response(400, f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}")

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(
            500, f"internal error ({type(e).__name__}); the server keeps serving", type="server_error"
        )


class Gate:
    """Pure ASGI middleware: 503 while draining, 413 by Content-Length, response counts for /metrics."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.s = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        route = next((r for r in ROUTES if path == r or path.startswith(r + "/")), "other")
        status = 500

        async def counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope, path)
            if refusal is not None:
                await refusal(scope, receive, counted)
                return
            if not self.s.client.started and not self.s.draining:
                self.s.client.start()  # served without a lifespan (some test clients): start on first use
            await self.app(scope, receive, counted)
        finally:
            self.s.metrics.observe_response(route, status)

    def _refusal(self, scope: Scope, path: str) -> Response | None:
        if self.s.draining and path not in OPEN_WHILE_DRAINING:
            return error_response(
                503,
                "the server is shutting down; retry on another replica",
                type="server_error",
                code="draining",
                headers={"Retry-After": str(self.s.retry_after_s), "Connection": "close"},
            )
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.s.max_body_bytes:
            return error_response(
                413,
                f"request body of {int(length)} bytes is over the {self.s.max_body_bytes}-byte limit",
                code="request_too_large",
            )
        return None
