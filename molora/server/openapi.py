"""Request-body schemas in the OpenAPI document, for routes that parse their bodies by hand (guards.parse_body).

    @app.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
    ...
    hoist_defs(app)          # the bodies' pydantic $defs become components/schemas

A route that reads `Request` itself gives FastAPI no body model, so `app.openapi()` would list none. `json_body`
declares the model's JSON schema as the route's required `application/json` body, its `$ref`s already pointing
into `#/components/schemas`; `hoist_defs` wraps `app.openapi` so that each body's `$defs` move there. Knows
pydantic and FastAPI's OpenAPI dict; nothing of what a route does.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

__all__ = ["REF_TEMPLATE", "hoist_defs", "json_body"]

REF_TEMPLATE = "#/components/schemas/{model}"


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra`: `model`'s validation schema as its required JSON request body (its `$defs` kept
    inside until `hoist_defs` moves them)."""
    schema = model.model_json_schema(ref_template=REF_TEMPLATE)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def hoist_defs(app: FastAPI) -> None:
    """Make `app.openapi()` move every request body's `$defs` into `components/schemas` (same name, same model:
    the definitions agree)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = build()
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for ops in doc.get("paths", {}).values():
            for op in ops.values():
                for media in op.get("requestBody", {}).get("content", {}).values():
                    schema = media.get("schema", {})  # may be the route's own openapi_extra: not changed in place
                    schemas.update(schema.get("$defs", {}))
                    media["schema"] = {k: v for k, v in schema.items() if k != "$defs"}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
